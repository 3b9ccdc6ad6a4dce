"""The survivors' copy: the newest completed step, kept while the next one runs.

In data parallelism every process holds the whole state of the last step it
completed. :func:`jdp.fit` with ``Checkpointer(local_directory=...)`` keeps
that state alive (a step that does not donate its input leaves it intact while
the next step runs); when the job fails, each process that is still alive
writes it to fast local storage on its way out (the fail-fast exit, SIGTERM
from a launcher or scheduler). The restarted job, on any number of processes,
resumes from the newest step any process wrote, when it is newer than the disk
checkpoint: a failure of some processes costs no completed step. A state that
``zero1`` or ``fsdp`` splits into rows is covered too: in each step every
process also receives a copy of the next process's rows (:func:`copying`,
:mod:`jdp._peer_rows`), and the restart gathers the rows from the processes
that hold them.

A copy belongs to one run: the first ``fit`` on a checkpoint folder writes a
run id into it, and copies of another run (a folder deleted and started over)
are ignored and removed.
"""

import collections
import contextlib
import json
import os
import pathlib
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp import _layout, _peer_rows, distributed
from jdp._steps import TrainStep, wraps
from jdp._tree import PyTree, is_prng_key

_KEPT = 3  # states held at most: the newest completed one and the steps in flight
# How long the exit path waits for a held step to complete: a step whose metrics were
# read completes on the other devices within milliseconds (each device's outputs are
# ready when its own part of the program ends), while a step blocked in a collective
# with a failed peer never does.
_GRACE = 1.0
_RUN_FILE = "jdp-run-id"
_ROWS = "jdp.next_rows"  # the metrics entry of copying()'s step


class Standby:
    """The newest steps ``fit`` ran, kept until a newer one completes.

    Args:
      folder: this run's folder of copies (``local_directory/run-<run id>``).
      index: this process's index, in the copies' file names.
    """

    def __init__(self, folder: pathlib.Path, index: int):
        self.folder, self.index = folder, index
        # (step, state, its rows' copies, data position, the arrays that tell it completed)
        self._kept: collections.deque[tuple[int, PyTree, Any, Any, list]] = collections.deque()
        self._history: Any = None
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # the SIGTERM thread and the exit path may both write
        self.written: int | None = None
        self.on_drop: Callable[[PyTree], None] | None = None  # given each state no longer held

    def keep(
        self, step: int, state: PyTree, position: Any, history: Any, rows: list | None = None
    ) -> None:
        """Holds ``state`` (after ``step``); drops those older than the newest completed one.

        At most ``_KEPT`` are held: past that, this waits for the oldest but
        one to complete, so dispatch runs at most two steps ahead of the device.
        Rows a strategy split over the processes are held on the previous
        process too, so no single process holds the only copy: ``rows``, the
        step's own copy (:func:`next_rows`), or else one collective now.
        """
        copies = _copies(state) if rows is None else _per_leaf(state, rows)
        with self._lock:
            self._kept.append((step, state, copies, position, _firsts(state, copies)))
            self._history = history
            while len(self._kept) > 1 and _settled(self._kept[1]) is True:
                self._drop()
        if len(self._kept) > _KEPT:
            self.make_room()

    def make_room(self) -> None:
        """With ``_KEPT`` states held or more, waits for the second oldest and drops the oldest."""
        if len(self._kept) < _KEPT:
            return
        with contextlib.suppress(Exception):  # a failed step: fit reports it
            for x in self._kept[1][4]:
                x.block_until_ready()
        with self._lock:
            if _settled(self._kept[1]) is True:
                self._drop()

    def _drop(self) -> None:
        state = self._kept.popleft()[1]
        if self.on_drop is not None:
            self.on_drop(state)

    def write(self, grace: float = 0.0) -> int | None:
        """Writes the newest completed step held to this run's folder; returns it (None: none).

        Called on the way out of a failing job, from whichever thread ends the
        process, while the main thread may be blocked in a collective: it
        reads only buffers that are complete and runs no computation. Held
        steps still running get ``grace`` seconds in all to complete.
        """
        with self._writing:
            return self._write_newest(time.monotonic() + grace)

    def _write_newest(self, until: float) -> int | None:
        with self._lock:
            kept, history = list(self._kept), self._history
        for step, state, copies, position, _ in reversed(kept):
            if self.written is not None and step <= self.written:
                return self.written
            _await((state, [c for c in copies if c is not None]), until)
            host = _host_copy(state, copies)
            if host is None:
                continue
            arrays, leaves = host
            meta = {"step": step, "data": position, "history": _history_until(history, step)}
            _write(self.folder, f"{step}.{self.index}", arrays, meta | {"leaves": leaves})
            self.written = step
            return step
        return None

    def remove(self) -> None:
        """Removes this run's copies (the run finished, or resumed past them)."""
        for path in self.folder.glob("*.npz"):
            with contextlib.suppress(OSError):
                path.unlink()


# The standby of the fit loop running now (or of the one an exception just left).
_ACTIVE: list[Standby] = []


@contextlib.contextmanager
def active(standby: Standby | None):
    """While inside, a failure of this process writes ``standby`` out first.

    An exception leaving the block keeps it: the exit path (the exception
    hook) runs after the exception has left ``fit``. The next ``fit``
    replaces it, so a notebook that catches the exception holds one at most.
    """
    _ACTIVE[:] = [] if standby is None else [standby]
    yield
    _ACTIVE.clear()


def write_active(timeout: float) -> None:
    """The exit paths' hook: writes the loop's newest completed step, and says so.

    A held step still running gets up to ``min(timeout, 1 s)`` to complete.
    """
    for standby in list(_ACTIVE):
        before = standby.written
        try:
            step = standby.write(min(timeout, _GRACE))
        except Exception as e:  # an exit path must go on: the disk checkpoint remains
            sys.stderr.write(f"[jdp] could not write the survivors' copy: {e!r}\n")
            continue
        if step is not None and step != before:
            sys.stderr.write(
                f"[jdp] process {standby.index} kept step {step} in {standby.folder}\n"
            )
            sys.stderr.flush()


distributed.before_fatal_exit(write_active, first=True)


def run_folder(local_directory: pathlib.Path, checkpoint_directory: pathlib.Path) -> pathlib.Path:
    """``local_directory/run-<run id>``: the run id is made once per checkpoint folder.

    Process 0 creates it; every process reads it after a barrier.
    """
    marker = checkpoint_directory / _RUN_FILE
    if jax.process_index() == 0 and not marker.exists():
        checkpoint_directory.mkdir(parents=True, exist_ok=True)
        temporary = marker.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(uuid.uuid4().hex)
        os.replace(temporary, marker)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jdp standby run id")
    run = marker.read_text().strip()
    for other in local_directory.glob("*"):  # copies of an earlier run into this folder
        if other.name != f"run-{run}" and _owner(other) == str(checkpoint_directory):
            _remove_tree(other)
    folder = local_directory / f"run-{run}"  # never an integer: not a step for Orbax
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".checkpoints").write_text(str(checkpoint_directory))
    return folder


def _ready(state: PyTree) -> bool:
    arrays = [_data(x) for x in jax.tree.leaves(state)]
    return all(x.is_ready() for x in arrays if isinstance(x, jax.Array))  # type: ignore[attr-defined]


def _await(arrays: PyTree, until: float) -> None:
    """Waits, polling, until ``arrays`` are ready or the clock passes ``until``.

    Polls rather than blocks: a step that never completes must not hold the exit path.
    """
    while not _ready(arrays) and time.monotonic() < until:
        time.sleep(0.001)


def _settled(entry: tuple) -> bool | None:
    """How the step that made a held state ended: True done, False failed, None running.

    The copy of its split rows counts too (:func:`_firsts`, kept with the entry).
    """
    firsts = entry[4]
    if not all(x.is_ready() for x in firsts):
        return None
    try:  # ready: returns at once, or raises the computation's error
        for x in firsts:
            x.block_until_ready()
    except Exception:
        return False
    return True


def _firsts(state: PyTree, copies: list) -> list[jax.Array]:
    """An array of ``state`` and one of its rows' copy: each completes with the rest.

    The outputs of one computation complete together, so one leaf of each
    tells; found once per held state, as a main thread that works between
    steps competes with the devices' threads for the cores.
    """
    firsts = [_first_array(state)] + [c for c in copies if c is not None][:1]
    return [x for x in firsts if x is not None]


def _first_array(state: PyTree) -> jax.Array | None:
    for x in jax.tree.leaves(state):
        x = _data(x)
        if isinstance(x, jax.Array):
            return x
    return None


def _data(x: Any) -> Any:
    """A PRNG key's data (its own array: no computation), any other leaf unchanged."""
    return jax.random.key_data(x) if isinstance(x, jax.Array) and is_prng_key(x) else x


def copying(step: TrainStep) -> TrainStep:
    """``step`` that also sends each split row of its new state to the previous process.

    The copy is part of the step, so it completes with the step: a step that
    completed on a survivor left that survivor the rows of the process after
    it, even when that process died right after. The rows come back as a
    metrics entry that :func:`next_rows` takes out.
    """

    def fn(state: Any, batch: PyTree) -> Any:
        state, metrics = step(state, batch)
        return state, {**metrics, _ROWS: _peer_rows.in_step(_split(state), step.axis_name)}

    return wraps(step)(fn)


def next_rows(metrics: dict[str, Any]) -> list[jax.Array] | None:
    """Takes :func:`copying`'s rows out of a step's metrics (None: the step sends none)."""
    return metrics.pop(_ROWS, None)


def sends_rows(state: PyTree) -> bool:
    """Whether a step on ``state`` should send rows: a split state over several processes."""
    return jax.process_count() > 1 and any(_layout.per_replica_leaves(state))


def _split(state: PyTree) -> list[jax.Array]:
    """The leaves of ``state`` a strategy split into rows, in flatten order."""
    leaves = jax.tree.leaves(state)
    return [x for x, s in zip(leaves, _layout.per_replica_leaves(state), strict=True) if s]


def _per_leaf(state: PyTree, rows: list[jax.Array]) -> list[jax.Array | None]:
    """``rows`` (one per split leaf) spread over every leaf of ``state``; None for the others."""
    moved = iter(rows)
    return [next(moved) if s else None for s in _layout.per_replica_leaves(state)]


def _copies(state: PyTree) -> list[jax.Array | None]:
    """Per leaf, the next process's rows of a split leaf (None: not split, or one process)."""
    if not sends_rows(state):
        return [None] * len(jax.tree.leaves(state))
    return _per_leaf(state, _peer_rows.next_rows(_split(state)))


def _host_copy(state: PyTree, copies: list[jax.Array | None]):
    """This process's copy of each leaf on the host: ``(arrays, leaf descriptions)``.

    None if a leaf is not complete. Read from device buffers, with no
    computation dispatched: a failing process's devices may be blocked in the
    step that never completes. A split leaf gives the rows this process holds.
    """
    split = _layout.per_replica_leaves(state)
    leaves = jax.tree.leaves(state)
    try:
        if not _ready((leaves, [c for c in copies if c is not None])):
            return None
        arrays: dict[str, np.ndarray] = {}
        described: list[dict[str, Any]] = []
        for i, (x, is_split, copy) in enumerate(zip(leaves, split, copies, strict=True)):
            if not is_split:
                arrays[f"leaf{i}"] = value = _read_replica(x)
                described.append({"shape": list(value.shape), "dtype": str(value.dtype)})
                continue
            rows = _peer_rows.held(x, copy)
            arrays[f"index{i}"] = np.asarray(sorted(rows), np.int64)
            arrays[f"rows{i}"] = np.stack([rows[r] for r in sorted(rows)])
            row = arrays[f"rows{i}"].shape[1:]
            n = _peer_rows.row_count(x)
            described.append({"rows": n, "shape": list(row), "dtype": str(x.dtype)})
        return arrays, described
    except Exception:  # a step that failed: its outputs hold an error, not a state
        return None


def _read_replica(x: Any) -> np.ndarray:
    x = _data(x)
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    layout = _layout.layout_of_leaf(x)
    if layout is _layout.MESH_REPLICATED:  # whole, also where split over model axes
        return _layout.host_value(x)
    value = np.array(min(x.addressable_shards, key=lambda s: s.device.id).data)
    return value[0] if layout is _layout.LEADING_AXIS else value


def _history_until(history: Any, step: int) -> dict[str, Any] | None:
    if history is None:
        return None
    return {
        "train": [r for r in list(history.train) if r["step"] <= step],
        "eval": [r for r in list(history.eval) if r["step"] <= step],
        "resumed_at": list(history.resumed_at),
        "time": dict(history.time),
    }


def _write(folder: pathlib.Path, name: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """``folder/name.npz``, whole or not at all (written aside, then renamed).

    Not synced to disk: the copy has to outlive this process, not the host
    (the disk checkpoint is for that), and a sync would make the write lose
    the race against JAX's exit when process 0 is gone.
    """
    text = json.dumps(meta, default=_jsonable).encode()
    temporary = folder / f".{name}.tmp.npz"
    with open(temporary, "wb") as f:
        named: Any = arrays
        np.savez(f, meta=np.frombuffer(text, np.uint8), **named)
    os.replace(temporary, folder / f"{name}.npz")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(
        f"jdp.fit: the survivors' copy cannot write a {type(value).__name__} in its data "
        "position or history as JSON; give train_data a get_state() of JSON values."
    )


def _owner(folder: pathlib.Path) -> str | None:
    """The checkpoint folder whose run ``folder`` holds copies of (None: not a run folder)."""
    try:
        return (folder / ".checkpoints").read_text()
    except OSError:
        return None


def _remove_tree(folder: pathlib.Path) -> None:
    for path in folder.glob("*"):
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()

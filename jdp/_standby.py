"""The survivors' copy: the newest completed step, kept while the next one runs.

In data parallelism every process holds the whole state of the last step it
completed. :func:`jdp.fit` with ``Checkpointer(local_directory=...)`` keeps
that state alive (a step that does not donate its input leaves it intact while
the next step runs); when the job fails, each process that is still alive
writes it to fast local storage on its way out (the fail-fast exit, SIGTERM
from a launcher or scheduler). The restarted job, on any number of processes,
resumes from the newest step any process wrote, when it is newer than the disk
checkpoint: a failure of some processes costs no completed step.

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
import uuid
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp import _layout, distributed
from jdp._replication import place_like, replicate
from jdp._tree import PyTree, is_prng_key

_KEPT = 3  # states held at most: the newest completed one and the steps in flight
_RUN_FILE = "jdp-run-id"


class Standby:
    """The newest steps ``fit`` ran, kept until a newer one completes.

    Args:
      folder: this run's folder of copies (``local_directory/<run id>``).
      index: this process's index, in the copies' file names.
    """

    def __init__(self, folder: pathlib.Path, index: int):
        self.folder, self.index = folder, index
        self._kept: collections.deque[tuple[int, PyTree, Any]] = collections.deque()
        self._history: Any = None
        self._lock = threading.Lock()
        self.written: int | None = None

    def keep(self, step: int, state: PyTree, position: Any, history: Any) -> None:
        """Holds ``state`` (after ``step``); drops those older than the newest completed one.

        At most ``_KEPT`` are held: past that, this waits for the oldest but
        one to complete, so dispatch runs at most two steps ahead of the device.
        """
        with self._lock:
            self._kept.append((step, state, position))
            self._history = history
            while len(self._kept) > 1 and _done(self._kept[1][1]):
                self._kept.popleft()
        if len(self._kept) > _KEPT:
            jax.block_until_ready(self._kept[1][1])
            with self._lock:
                self._kept.popleft()

    def write(self) -> int | None:
        """Writes the newest completed step held to this run's folder; returns it (None: none).

        Called on the way out of a failing job, from whichever thread ends the
        process, while the main thread may be blocked in a collective: it
        reads only buffers that are complete and runs no computation.
        """
        with self._lock:
            kept, history = list(self._kept), self._history
        for step, state, position in reversed(kept):
            if self.written is not None and step <= self.written:
                return self.written
            host = _host_copy(state)
            if host is None:
                continue
            meta = {"step": step, "data": position, "history": _history_until(history, step)}
            _write(self.folder, f"{step}.{self.index}", host, meta)
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
    """The exit paths' hook: writes the loop's newest completed step, and says so."""
    del timeout  # a host copy of complete buffers: milliseconds, nothing to bound
    for standby in list(_ACTIVE):
        try:
            step = standby.write()
        except Exception as e:  # an exit path must go on: the disk checkpoint remains
            sys.stderr.write(f"[jdp] could not write the survivors' copy: {e!r}\n")
            continue
        if step is not None:
            sys.stderr.write(
                f"[jdp] process {standby.index} kept step {step} in {standby.folder}\n"
            )
            sys.stderr.flush()


distributed.before_fatal_exit(write_active, first=True)


def run_folder(local_directory: pathlib.Path, checkpoint_directory: pathlib.Path) -> pathlib.Path:
    """``local_directory/<run id>``: the run id is made once per checkpoint folder.

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
        if other.name != run and _owner(other) == str(checkpoint_directory):
            _remove_tree(other)
    folder = local_directory / run
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".checkpoints").write_text(str(checkpoint_directory))
    return folder


def restore(
    folder: pathlib.Path, template: PyTree, newer_than: int | None
) -> tuple[PyTree, dict[str, Any]] | None:
    """The newest copy any process holds, if newer than ``newer_than``: ``(state, meta)`` or None.

    Every process says which step it holds (one small collective); the first
    process holding the newest sends it to all, placed like ``template``.
    """
    held = newest(folder)
    steps = _gather(-1 if held is None else held[0])
    best = max(steps)
    if best < 0 or (newer_than is not None and best <= newer_than):
        return None
    source = steps.index(best)
    mine = source == jax.process_index()
    leaves, treedef = jax.tree_util.tree_flatten(template)
    if mine and held is not None:  # the source holds the step it announced
        values, meta_bytes = _read(held[1], len(leaves))
    else:
        values, meta_bytes = [_zeros_like_logical(x) for x in leaves], np.zeros(0, np.uint8)
    values = _broadcast(values, mine)
    meta = json.loads(bytes(_broadcast_bytes(meta_bytes, mine)).decode())
    logical = [_rewrap(x, v) for x, v in zip(leaves, values, strict=True)]
    state = _place(template, jax.tree_util.tree_unflatten(treedef, logical))
    if jax.process_index() == 0:
        disk = "none" if newer_than is None else str(newer_than)
        sys.stderr.write(
            f"[jdp] resuming at step {best} from the survivors' copy, read by process "
            f"{source} (the newest checkpoint on disk: {disk})\n"
        )
        sys.stderr.flush()
    return state, meta


def newest(folder: pathlib.Path) -> tuple[int, pathlib.Path] | None:
    """The newest complete copy in ``folder`` (any process's): ``(step, path)``."""
    found = []
    for path in folder.glob("*.npz"):
        step, _, _ = path.stem.partition(".")
        if step.isdigit():
            found.append((int(step), path))
    return max(found) if found else None


def check_state(state: PyTree) -> None:
    """Refuses a state a strategy split over the processes (no process holds all of it)."""
    if _layout.has_per_replica(state):
        raise ValueError(
            "jdp.fit: Checkpointer(local_directory=...) keeps the survivors' copy of the "
            "state, but this state's strategy splits it across the replicas (zero1, fsdp), "
            "so no process holds all of it. Train with data_parallel() or exact(), or drop "
            "local_directory to resume from the disk checkpoints."
        )


def _ready(state: PyTree) -> bool:
    arrays = [_data(x) for x in jax.tree.leaves(state)]
    return all(x.is_ready() for x in arrays if isinstance(x, jax.Array))  # type: ignore[attr-defined]


def _done(state: PyTree) -> bool:
    """Whether the step that made ``state`` finished (its outputs complete together)."""
    for x in jax.tree.leaves(state):
        x = _data(x)
        if isinstance(x, jax.Array):
            return x.is_ready()  # type: ignore[attr-defined]
    return True


def _data(x: Any) -> Any:
    """A PRNG key's data (its own array: no computation), any other leaf unchanged."""
    return jax.random.key_data(x) if isinstance(x, jax.Array) and is_prng_key(x) else x


def _host_copy(state: PyTree) -> list[np.ndarray] | None:
    """This process's copy of each leaf on the host, None if a leaf is not complete.

    Read from a device buffer, with no computation dispatched: a failing
    process's devices may be blocked in the step that never completes.
    """
    try:
        if not _ready(state):
            return None
        return [_read_replica(x) for x in jax.tree.leaves(state)]
    except Exception:  # a step that failed: its outputs hold an error, not a state
        return None


def _read_replica(x: Any) -> np.ndarray:
    x = _data(x)
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    layout = _layout.layout_of_leaf(x)
    first = min(x.addressable_shards, key=lambda s: s.device.id).data
    value = np.array(first)
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


def _write(folder: pathlib.Path, name: str, host: list[np.ndarray], meta: dict) -> None:
    """``folder/name.npz``, whole or not at all (written aside, then renamed)."""
    text = json.dumps(meta, default=_jsonable).encode()
    temporary = folder / f".{name}.tmp.npz"
    with open(temporary, "wb") as f:
        arrays: Any = {f"leaf{i}": v for i, v in enumerate(host)}
        np.savez(f, meta=np.frombuffer(text, np.uint8), **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / f"{name}.npz")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _read(path: pathlib.Path, count: int) -> tuple[list[np.ndarray], np.ndarray]:
    with np.load(path) as saved:
        return [saved[f"leaf{i}"] for i in range(count)], saved["meta"]


def _zeros_like_logical(x: Any) -> np.ndarray:
    x = _data(x)
    layout = _layout.layout_of_leaf(x) if isinstance(x, jax.Array) else None
    shape = np.shape(x)[1:] if layout is _layout.LEADING_AXIS else np.shape(x)
    return np.zeros(shape, np.asarray(x).dtype if not isinstance(x, jax.Array) else x.dtype)


def _rewrap(template: Any, value: np.ndarray) -> Any:
    if isinstance(template, jax.Array) and is_prng_key(template):
        return jax.random.wrap_key_data(
            jax.numpy.asarray(value), impl=jax.random.key_impl(template)
        )
    return value


def _place(template: PyTree, value: PyTree) -> PyTree:
    if _layout.layout_of(template) is None:
        return _layout.place_like(template, value, replicate)
    return place_like(template, value)


def _gather(step: int) -> list[int]:
    if jax.process_count() == 1:
        return [step]
    return [int(s) for s in np.asarray(multihost_utils.process_allgather(np.int64(step)))]


def _broadcast(values: list[np.ndarray], mine: bool) -> list[np.ndarray]:
    if jax.process_count() == 1:
        return values
    return [np.asarray(v) for v in multihost_utils.broadcast_one_to_all(values, is_source=mine)]


def _broadcast_bytes(data: np.ndarray, mine: bool) -> np.ndarray:
    if jax.process_count() == 1:
        return data
    size = int(
        np.asarray(multihost_utils.broadcast_one_to_all(np.int64(data.size), is_source=mine))
    )
    padded = data if mine else np.zeros(size, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(padded, is_source=mine))


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

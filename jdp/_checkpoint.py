"""Checkpoints on Orbax: one copy written atomically, restored in sync everywhere.

Caffe2's ``FinalizeAfterCheckpoint`` re-broadcast parameters and the iteration
counter after a load; here the whole training state is restored replicated
and in sync on the current devices, whatever device count wrote it.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import threading
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp import _layout, distributed
from jdp._args import check_bool, check_int
from jdp._replication import place_like, refuse_consumed, replicate, unreplicate
from jdp._state import TrainState
from jdp._tree import PyTree, is_prng_key
from jdp.metrics import host_fingerprints

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

FORMAT_VERSION = 1
# What a damaged or unreadable checkpoint raises (JSON and tensorstore errors
# are ValueErrors, missing files OSErrors). Anything else is a bug or an
# interrupt and propagates instead of silently falling back.
READ_ERRORS = (OSError, ValueError, KeyError, EOFError)
_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


class CheckpointError(RuntimeError):
    """No intact checkpoint could be restored."""


class Checkpointer:
    """Saves and restores training state with ``orbax.checkpoint.CheckpointManager``.

    Each checkpoint holds one copy of the state (replica 0, written by process
    0) as Orbax arrays (no pickles) plus a JSON item with ``extra`` and the
    static fields of the loss scale. Orbax writes into a temporary directory
    and renames it when complete, so a run killed mid-write leaves the
    previous checkpoints intact.

    Args:
      directory: where step directories live; created if missing.
      max_to_keep: keep only the newest this many checkpoints (None: all).
      async_save: write in a background thread; call
        :meth:`wait_until_finished` before reading or exiting.
      local_directory: fast storage on each host (e.g. ``/dev/shm/my-run``)
        for the survivors' copy: :func:`jdp.fit` keeps the newest completed
        step in memory, the processes still alive write it here when the job
        fails, and the restarted job resumes from it when it is newer than
        the newest checkpoint, so a failure of some processes loses no
        completed step (``docs/checkpointing.md``). Needs a step that keeps
        its input state: ``donate_state=False``.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, jdp
      >>> state = jdp.replicate(jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1)))
      >>> ckpt = jdp.Checkpointer(tempfile.mkdtemp())
      >>> ckpt.save(0, state, extra={"epoch": 1})
      >>> restored, extra = ckpt.restore(state)
      >>> extra, restored.params.shape
      ({'epoch': 1}, (8, 3))
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = False,
        local_directory: str | pathlib.Path | None = None,
    ):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                f"jdp.Checkpointer: max_to_keep must be None or an int >= 1, got {max_to_keep!r}."
            )
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"jdp.Checkpointer: directory must be a path (str or pathlib.Path), got {directory!r}."
            )
        check_bool(async_save, "async_save", where="jdp.Checkpointer")
        if local_directory is not None and not isinstance(local_directory, (str, os.PathLike)):
            raise TypeError(
                "jdp.Checkpointer: local_directory must be a path (str or pathlib.Path) or "
                f"None, got {local_directory!r}."
            )
        self.local_directory = (
            None
            if local_directory is None
            else pathlib.Path(local_directory).expanduser().absolute()
        )
        self.directory = pathlib.Path(directory).expanduser().absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(
                f"jdp.Checkpointer: {self.directory} is a file; pass a directory (it is created "
                "if missing) where the step directories will live."
            )
        _check_one_folder(self.directory)
        # Imported here: Orbax (with tensorstore) takes longer to import than
        # the rest of jdp, and a script that never checkpoints should not pay it.
        import orbax.checkpoint as ocp

        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
        )
        with _quiet_orbax():  # it logs unreadable step metadata; restore reports it once
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    "state": ocp.PyTreeCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(),
                },
            )
        _OPEN.add(self)

    def save(self, step: int, state: PyTree, *, extra: dict[str, Any] | None = None) -> None:
        """Writes ``state`` (as the loop holds it, replicated or not) as checkpoint ``step``.

        Args:
          step: the checkpoint's number, usually ``int(state.step)``.
          state: a TrainState or any pytree of arrays.
          extra: small JSON-able things saved with it (iterator position, config).

        Raises:
          TypeError: ``extra`` is not JSON-serializable, or ``step`` is not an int.
          ValueError: ``step`` is negative, a checkpoint ``step`` already exists, or a
            newer one does.
        """
        step = check_int(step, "step", minimum=0, where="jdp.Checkpointer.save")
        refuse_consumed(state, "jdp.Checkpointer.save")
        _refuse_objects(state)
        meta = {"format": FORMAT_VERSION, "static": _static_fields(state), "extra": extra}
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"jdp.Checkpointer.save: extra must be JSON-serializable (dicts, lists, str, "
                f"int, float, bool, None); {e}."
            ) from None
        steps = self._manager.all_steps()
        if step in steps:
            raise ValueError(
                f"jdp.Checkpointer.save: checkpoint {step} already exists in {self.directory}."
            )
        if steps and step < max(steps):
            # Orbax would skip it without a word: it only saves steps past the newest.
            raise ValueError(
                f"jdp.Checkpointer.save: step {step} is older than checkpoint {max(steps)} in "
                f"{self.directory}; checkpoints must be saved in increasing step order. Use "
                "another directory for a run that starts over."
            )
        copy = _global_copy(_whole(state))
        meta["fingerprint"] = _fingerprints(copy)
        arrays = _nest({parts: leaf for parts, _, leaf in _leaves(copy)})
        import orbax.checkpoint as ocp

        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore(
        self,
        template: PyTree,
        step: int | None = None,
        *,
        place: Callable[[PyTree], PyTree] | None = None,
    ) -> tuple[PyTree, dict[str, Any]]:
        """Restores a checkpoint into the structure of ``template``.

        Args:
          template: a state of the same structure, shapes and dtypes (e.g. a
            freshly created, or the current, TrainState); its static fields
            (optimizer, loss-scale hyperparameters) and layout are kept.
          step: which checkpoint; default the newest intact one. A damaged
            newest checkpoint is skipped with a warning naming it.
          place: how to place the restored single copy; default the
            template's layout: ``jdp.replicate`` on its devices (pmap layout,
            also for an unreplicated template) or ``jdp.replicate_across`` on
            its mesh (shard_map layout).

        Returns:
          ``(state, extra)``: the state replicated and in sync on the current
          devices, and the ``extra`` saved with it (``{}`` if none was).

        Raises:
          FileNotFoundError: there is no checkpoint (or no checkpoint ``step``).
          ValueError: the checkpoint does not match the template; the message
            names the leaf and both shapes and dtypes.
          CheckpointError: every candidate checkpoint is damaged.
        """
        steps = self.all_steps()
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(
                    f"jdp.Checkpointer.restore: no checkpoint {step} in {self.directory}; available: {steps}."
                )
            candidates = [int(step)]
        else:
            candidates = sorted(steps, reverse=True)
        if not candidates:
            raise FileNotFoundError(f"jdp.Checkpointer.restore: no checkpoint in {self.directory}.")
        refuse_consumed(template, "jdp.Checkpointer.restore (the template)")
        expected = _leaves(_one_copy(template))
        failures = []
        for candidate in _agreed(candidates):
            # Every process restores the same step or none does: a fallback
            # taken on one process only would let the processes diverge. The
            # decision is agreed after each read, before Orbax's own barriers.
            saved, error = self._read_metadata(candidate)
            if _all_processes_ok(error is None):
                _check_layout(saved, expected, candidate)
                restored, error = self._read_data(candidate, expected)
                if _all_processes_ok(error is None):
                    break
            failures.append((candidate, error or RuntimeError("failed on another process")))
        else:
            raise CheckpointError(
                f"jdp.Checkpointer.restore: no intact checkpoint in {self.directory}: {_describe(failures)}. "
                "Delete the damaged step directories or start from scratch."
            )
        meta = restored["meta"]
        _check_format(meta, candidate, self.directory)
        _check_static(meta["static"], _static_fields(template), candidate)
        if failures:
            warnings.warn(
                f"Skipped damaged checkpoint(s) {_describe(failures)} in {self.directory}; "
                f"restored step {candidate}.",
                RuntimeWarning,
                stacklevel=2,
            )
        state = _rebuild(template, expected, _flatten_nested(restored["state"]))
        return (place or _placement_like(template))(state), meta["extra"] or {}

    def fingerprints(self, step: int | None = None) -> dict[str, Any] | None:
        """The fingerprints recorded with checkpoint ``step`` (default the newest), without its arrays.

        Returns:
          ``{"state": [a, b], "leaves": {path: [a, b], ...}}``: the state's
          fingerprint and each leaf's, by its path in the logical state, as
          :func:`jdp.metrics.fingerprint` and
          :func:`jdp.metrics.leaf_fingerprints` report them inside a step;
          None for a checkpoint written before jdp recorded them.

        Raises:
          FileNotFoundError: there is no checkpoint (or no checkpoint ``step``).
        """
        return self._meta(step).get("fingerprint")

    def extra(self, step: int | None = None) -> dict[str, Any]:
        """The ``extra`` saved with checkpoint ``step`` (default the newest), without its arrays.

        Raises:
          FileNotFoundError: there is no checkpoint (or no checkpoint ``step``).
        """
        return self._meta(step).get("extra") or {}

    def _meta(self, step: int | None) -> dict[str, Any]:
        steps = self.all_steps()
        if not steps or (step is not None and int(step) not in steps):
            raise FileNotFoundError(
                f"jdp.Checkpointer: no checkpoint {'' if step is None else step} in {self.directory}; "
                f"available: {steps}."
            )
        import orbax.checkpoint as ocp

        chosen = steps[-1] if step is None else int(step)
        with _quiet_orbax():
            restored = self._manager.restore(
                chosen, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        return restored["meta"]

    def _read_metadata(self, step: int) -> tuple[Any, Exception | None]:
        """``(leaf shapes and dtypes, None)``, or ``(None, error)`` when damaged."""
        try:
            with _quiet_orbax():
                return _metadata_tree(self._manager.item_metadata(step)["state"]), None
        except READ_ERRORS as e:
            return None, e

    def _read_data(self, step: int, expected) -> tuple[Any, Exception | None]:
        """``(restored items, None)``, or ``(None, error)`` when damaged."""
        try:
            with _quiet_orbax():
                return self._manager.restore(step, args=_restore_args(expected)), None
        except READ_ERRORS as e:
            return None, e

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, or None (read from disk, see :meth:`all_steps`)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every complete checkpoint's step, oldest first.

        Read from the directory, so another Checkpointer on the same folder
        (an evaluation job watching a training run) is seen: Orbax keeps the
        list it read when it opened. While this Checkpointer's own save is in
        flight, the list it keeps is used.
        """
        if not self._manager.is_saving_in_progress():
            with _quiet_orbax():
                self._manager.reload()
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def finish_pending_saves(timeout: float) -> None:
    """Waits up to ``timeout`` seconds for every open Checkpointer's async saves.

    For exit paths that skip ``atexit`` (``jdp.launch``'s handler of an
    uncaught exception): an in-flight checkpoint is finished, not lost.
    """

    def wait():
        for ckpt in list(_OPEN):
            with contextlib.suppress(Exception):
                ckpt.wait_until_finished()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(timeout)


distributed.before_fatal_exit(finish_pending_saves)


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs every failed read at ERROR; jdp reports one warning instead."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_format(meta: Any, step: int, directory: pathlib.Path) -> None:
    """Refuses a checkpoint written in a format this jdp does not read."""
    written = meta.get("format") if isinstance(meta, dict) else None
    if written != FORMAT_VERSION:
        raise ValueError(
            f"jdp.Checkpointer.restore: checkpoint {step} in {directory} has format {written!r}, but this jdp reads "
            f"format {FORMAT_VERSION}: it was written by another jdp version (or not by "
            "jdp). Restore it with the jdp that wrote it, or start from scratch."
        )


def _check_one_folder(directory: pathlib.Path) -> None:
    """Every process names the same folder (a collective when there are several).

    The processes write each checkpoint together; given a folder each, Orbax's
    first save waits for the others' files until JAX's timeout aborts the job.
    """
    if jax.process_count() == 1:
        return
    text = str(directory).encode()
    row = np.zeros(_FOLDER_BYTES + 32, np.uint8)
    row[:32] = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
    row[32 : 32 + min(len(text), _FOLDER_BYTES)] = np.frombuffer(text[:_FOLDER_BYTES], np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row))
    if all(np.array_equal(r[:32], rows[0][:32]) for r in rows):
        return
    folders = [bytes(r[32:]).rstrip(b"\0").decode(errors="replace") for r in rows]
    named = ", ".join(f"process {i}: {folder}" for i, folder in enumerate(folders))
    raise ValueError(
        f"jdp.Checkpointer: the processes name different folders ({named}). They write each "
        "checkpoint together: pass every process the same folder, on a file system they share."
    )


_FOLDER_BYTES = 1024  # of each path, to name it; the hash compares the whole path


def _agreed(candidates: list[int]) -> list[int]:
    """Process 0's candidate steps, on every process."""
    if jax.process_count() == 1:
        return candidates
    padded = np.full(64, -1, np.int64)
    padded[: min(len(candidates), 64)] = candidates[:64]
    chosen = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    return [int(c) for c in chosen if c >= 0]


def _all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _global_copy(tree: PyTree) -> PyTree:
    """One copy of each leaf, as device arrays Orbax writes from one replica.

    Leaves of a replicated state become global arrays replicated over their
    devices, built from each device's own copy: no process gathers the state
    into host memory (Orbax copies only the shard it writes). Other leaves
    (host arrays, single-device arrays) pass through. PRNG keys are saved as
    their key data.
    """

    def one(x):
        if is_prng_key(x):
            x = jax.random.key_data(x)
        layout = _layout.layout_of_leaf(x)
        if layout is None:
            return np.asarray(jax.device_get(x))
        return layout.global_copy(x)

    return jax.tree.map(one, tree)


def _fingerprints(copy: PyTree) -> dict[str, Any]:
    """The fingerprint of the state being saved, and of each leaf by its path."""
    total, rows = host_fingerprints(copy)
    paths = [path for _, path, _ in _leaves(copy)]
    return {"state": total, "leaves": dict(zip(paths, rows, strict=True))}


def _whole(tree: PyTree) -> PyTree:
    """State a strategy placed per replica (a split optimizer state) in its logical layout.

    Checkpoints hold the layout ``tx.init(params)`` returns, so a run restores
    into any strategy's layout and onto any device count.
    """
    return _layout.logical(tree, lambda leaf: leaf)


def _one_copy(tree: PyTree) -> PyTree:
    """Replica 0 of a replicated tree (either layout); other trees unchanged."""
    return tree if _layout.layout_of(tree) is None else unreplicate(tree)


def _placement_like(template: PyTree) -> Callable[[PyTree], PyTree]:
    """Places a restored (logical, one-copy) tree the way ``template`` is placed."""
    if _layout.layout_of(template) is None:  # a host template: the pmap layout
        return lambda tree: _layout.place_like(template, tree, replicate)
    return partial(place_like, template)


def _part(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaves(tree: PyTree) -> list[tuple[tuple[str, ...], str, Any]]:
    """``(orbax key parts, printable path, leaf)`` for every leaf.

    A tree that is a single leaf is stored under the key ``value``.
    """
    return [
        (tuple(_part(k) for k in path) or ("value",), jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _spec(leaf) -> tuple[tuple[int, ...], np.dtype]:
    if is_prng_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(np.shape(leaf)), np.dtype(
        leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    )


def _nest(flat: dict[tuple[str, ...], Any]) -> dict:
    root: dict = {}
    for parts, value in flat.items():
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return root


def _flatten_nested(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten_nested(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def _metadata_tree(metadata) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
    tree = getattr(metadata, "tree", metadata)
    return {
        parts: (tuple(m.shape), np.dtype(m.dtype)) for parts, m in _flatten_nested(tree).items()
    }


def _check_layout(saved, expected, step: int) -> None:
    wanted = {parts: (name, _spec(leaf)) for parts, name, leaf in expected}
    for parts, (name, (shape, dtype)) in wanted.items():
        if parts not in saved:
            raise ValueError(
                f"jdp.Checkpointer.restore: checkpoint {step} does not match the template: it has no leaf {name}. "
                "Restore with a template of the model that wrote it."
            )
        if saved[parts] != (shape, dtype):
            s_shape, s_dtype = saved[parts]
            raise ValueError(
                f"jdp.Checkpointer.restore: checkpoint {step} does not match the template at leaf {name}: saved "
                f"shape {s_shape} dtype {s_dtype}, template expects shape {shape} dtype {dtype}."
            )
    unexpected = sorted("/".join(p) for p in set(saved) - set(wanted))
    if unexpected:
        raise ValueError(
            f"jdp.Checkpointer.restore: checkpoint {step} does not match the template: it has leaves the template "
            f"lacks: {unexpected[:5]}."
        )


def _restore_args(expected) -> "ocp.args.Composite":
    import orbax.checkpoint as ocp

    restore_args = _nest(
        {parts: ocp.RestoreArgs(restore_type=np.ndarray) for parts, _, _ in expected}
    )
    return ocp.args.Composite(
        state=ocp.args.PyTreeRestore(restore_args=restore_args), meta=ocp.args.JsonRestore()
    )


def _rebuild(template: PyTree, expected, arrays: dict) -> PyTree:
    leaves = []
    for parts, _, leaf in expected:
        value = arrays[parts]
        if is_prng_key(leaf):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
        leaves.append(value)
    return jax.tree.unflatten(jax.tree.structure(_one_copy(template)), leaves)


def _static_fields(state: PyTree) -> dict[str, Any]:
    if not isinstance(state, TrainState):
        return {}
    scale = state.loss_scale
    fields = {
        f.name: getattr(scale, f.name)
        for f in dataclasses.fields(scale)
        if f.metadata.get("static", False)
    }
    return {"loss_scale": {"type": type(scale).__name__, **fields}}


def _check_static(saved: dict, expected: dict, step: int) -> None:
    if saved != expected:
        raise ValueError(
            f"jdp.Checkpointer.restore: checkpoint {step} was written with static settings {saved}, but the "
            f"template has {expected}. Restore with a template built like the saved "
            "run (e.g. the same DynamicLossScale hyperparameters), then change them "
            "with state.replace(...) if you mean to."
        )


def _describe(failures) -> str:
    return "; ".join(
        f"step {s} ({type(e).__name__}: {str(e).splitlines()[0][:200]})" for s, e in failures
    )


def _refuse_objects(state: PyTree) -> None:
    """Refuses a leaf a checkpoint cannot hold (a function, a module), naming it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex | str):
            raise TypeError(
                f"jdp.Checkpointer.save: leaf {jax.tree_util.keystr(path) or '<root>'} is a "
                f"{type(leaf).__name__}; a checkpoint holds arrays and numbers. Keep "
                "functions and objects out of the state (a static field of a jdp.dataclass "
                "state is not saved)."
            )

"""Reading the survivors' copy back (:mod:`jdp._standby` writes it).

Every process says which newest step it finds in its host's copies (one
small collective); when that step is newer than the disk checkpoint, the
first process holding it sends the leaves every replica holds alike, and the
rows of a split leaf (``zero1``, ``fsdp``) are gathered from whichever
processes hold them. The state is rebuilt in its logical layout and placed
like the template, so the restarted job may run on another number of
processes and devices.
"""

import json
import math
import pathlib
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jdp import _layout
from jdp._replication import place_like, replicate
from jdp._tree import PyTree, is_prng_key


def restore(
    folder: pathlib.Path, template: PyTree, newer_than: int | None
) -> tuple[PyTree, dict[str, Any]] | None:
    """The newest copy, if newer than ``newer_than``: ``(state, meta)`` or None.

    ``meta`` holds the step, the data position and the history. None also
    when the copy cannot make the whole state (rows of a split leaf lost
    with two processes, another model): then with a warning.
    """
    held = _held(folder)
    steps = _gather(max(held, default=-1))
    best = max(steps)
    if best < 0 or (newer_than is not None and best <= newer_than):
        return None
    source = steps.index(best)
    mine = source == jax.process_index()
    copies = [dict(np.load(path)) for path in held.get(best, [])]
    meta = json.loads(bytes(_broadcast_bytes(copies[0]["meta"] if mine else None, mine)).decode())
    leaves, treedef = jax.tree_util.tree_flatten(template)
    if len(meta["leaves"]) != len(leaves):
        _not_used(best, f"it holds {len(meta['leaves'])} leaves, the state {len(leaves)}")
        return None
    values = _values(copies, meta["leaves"], mine)
    if isinstance(values, str):
        _not_used(best, values)
        return None
    split = _layout.per_replica_leaves(template)
    host = [_as_template(x, values[i], meta["leaves"][i], split[i]) for i, x in enumerate(leaves)]
    logical = _layout.logical(jax.tree_util.tree_unflatten(treedef, host), lambda x: x)
    state = _place(template, logical)
    if jax.process_index() == 0:
        disk = "none" if newer_than is None else str(newer_than)
        sys.stderr.write(
            f"[jdp] resuming at step {best} from the survivors' copy, read by process "
            f"{source} (the newest checkpoint on disk: {disk})\n"
        )
        sys.stderr.flush()
    return state, meta


def newest(folder: pathlib.Path) -> int | None:
    """The newest step of which ``folder`` holds a copy (any process's)."""
    return max(_held(folder), default=None)


def _held(folder: pathlib.Path) -> dict[int, list[pathlib.Path]]:
    """The complete copies in ``folder`` by step (one file per process that wrote it)."""
    found: dict[int, list[pathlib.Path]] = {}
    for path in sorted(folder.glob("*.npz")):
        step, _, _ = path.stem.partition(".")
        if step.isdigit() and _readable(path):
            found.setdefault(int(step), []).append(path)
    return found


def _readable(path: pathlib.Path) -> bool:
    """Whether the file opens as a copy (a damaged one is skipped here, not on one process
    in the middle of the collectives that follow)."""
    try:
        with np.load(path) as copy:
            return "meta" in copy.files
    except Exception:
        return False


def _values(copies: list[dict], described: list[dict], mine: bool) -> list[np.ndarray] | str:
    """Every leaf's value: whole leaves from the source, split leaves' rows from all.

    A string says what is missing. Every process runs the same collectives.
    """
    whole = [i for i, d in enumerate(described) if "rows" not in d]
    sent = [copies[0][f"leaf{i}"] if mine else _zeros(described[i]) for i in whole]
    values: dict[int, np.ndarray] = dict(zip(whole, _broadcast(sent, mine), strict=True))
    for i, d in enumerate(described):
        if "rows" in d:
            rows = _all_rows(copies, i, d)
            if rows is None:
                return f"rows of its leaf {i} are on no process left"
            values[i] = rows
    return [values[i] for i in range(len(described))]


def _zeros(described: dict) -> np.ndarray:
    return np.zeros(described["shape"], jnp.dtype(described["dtype"]))


def _all_rows(copies: list[dict], i: int, d: dict) -> np.ndarray | None:
    """Leaf ``i``'s rows ``(n, ...)`` from every process that holds some (None: one is missing)."""
    rows = np.zeros((d["rows"], *d["shape"]), jnp.dtype(d["dtype"]))
    have = np.zeros(d["rows"], bool)
    for copy in copies:
        index = copy[f"index{i}"]
        rows[index], have[index] = copy[f"rows{i}"], True
    if jax.process_count() > 1:
        every = np.asarray(multihost_utils.process_allgather(rows))
        holders = np.asarray(multihost_utils.process_allgather(have))
        first = np.argmax(holders, axis=0)  # per row, the first process holding it
        rows = every[first, np.arange(d["rows"])]
        have = np.any(holders, axis=0)
    return rows if bool(np.all(have)) else None


def _as_template(x: Any, value: np.ndarray, described: dict, split: bool) -> Any:
    """A saved value in the form the template's leaf takes it (the logical read follows).

    A split leaf takes rows (the logical value is their flattened prefix, on
    any row count); a leaf held whole takes its value, cut from rows when the
    run that wrote it had split it.
    """
    if split:
        return value if "rows" in described else value.reshape(1, -1)
    if "rows" in described:
        shape = _replica_shape(x)
        value = value.reshape(-1)[: math.prod(shape)].reshape(shape)
    if isinstance(x, jax.Array) and is_prng_key(x):
        return jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(x))
    return value


def _replica_shape(x: Any) -> tuple[int, ...]:
    data = jax.random.key_data(x) if isinstance(x, jax.Array) and is_prng_key(x) else x
    leading = isinstance(data, jax.Array) and _layout.layout_of_leaf(data) is _layout.LEADING_AXIS
    return tuple(np.shape(data)[1:] if leading else np.shape(data))


def _not_used(step: int, why: str) -> None:
    warnings.warn(
        f"jdp.fit: the survivors' copy of step {step} is not used ({why}); resuming from "
        "the disk checkpoint.",
        RuntimeWarning,
        stacklevel=5,
    )


def _place(template: PyTree, value: PyTree) -> PyTree:
    if _layout.layout_of(template) is None:
        return _layout.place_like(template, value, replicate)
    return place_like(template, value)


def _gather(step: int) -> list[int]:
    if jax.process_count() == 1:
        return [step]
    return [int(s) for s in np.asarray(multihost_utils.process_allgather(np.int64(step)))]


def _broadcast(values: list[np.ndarray], mine: bool) -> list[np.ndarray]:
    if jax.process_count() == 1 or not values:
        return values
    return [np.asarray(v) for v in multihost_utils.broadcast_one_to_all(values, is_source=mine)]


def _broadcast_bytes(data: np.ndarray | None, mine: bool) -> np.ndarray:
    if jax.process_count() == 1:  # the source itself
        return np.zeros(0, np.uint8) if data is None else data
    size = 0 if data is None else data.size
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int64(size), is_source=mine)))
    padded = data if mine and data is not None else np.zeros(size, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(padded, is_source=mine))

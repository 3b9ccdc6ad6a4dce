"""A step's phases seen from the host, for :func:`jdp.verify.replay`.

A step marks the output of each phase: every replica's contributions after
its forward and backward passes, the reduced result, the updated state.
:func:`mark` does nothing unless the step is traced inside
:func:`observing`; there it adds a ``jax.debug.callback`` that sends the
phase's per-leaf fingerprints (the hashes of
:func:`jdp.metrics.leaf_fingerprints`) to a :class:`Record` on the host. The
callbacks only read values, so an observed step computes the same bits; an
ordinary step's graph holds none of this.
"""

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _layout
from jdp._tree import PyTree
from jdp.metrics._fingerprint import logical_hashes

FORWARD = "forward/backward"
REDUCTION = "reduction"
UPDATE = "update"
PHASES = (FORWARD, REDUCTION, UPDATE)


class Record:
    """One run's phase fingerprints on the host, step by step.

    ``names[phase]``: the phase's leaf names (set when the step is traced);
    ``rows[phase][replica]``: ``(leaves, 2)`` uint32, summed over the
    phase's marks on that replica since :meth:`take`.
    """

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        self.rows: dict[str, dict[int, np.ndarray]] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, replica: np.ndarray, hashes: np.ndarray) -> None:
        """A callback's rows: integer addition, so the marks' order does not matter."""
        with self._lock:
            per_replica = self.rows.setdefault(phase, {})
            old = per_replica.get(int(replica), np.zeros_like(hashes, np.uint32))
            per_replica[int(replica)] = old + np.asarray(hashes, np.uint32)

    def take(self) -> dict[str, dict[int, np.ndarray]]:
        """The rows since the last call, and a clean slate."""
        with self._lock:
            rows, self.rows = self.rows, {}
        return rows


_CURRENT: contextvars.ContextVar[Record | None] = contextvars.ContextVar("jdp_phases", default=None)


@contextlib.contextmanager
def observing(record: Record) -> Iterator[Record]:
    """Steps traced inside send their phases to ``record``.

    Tracing-time state that changes no result: it only adds callbacks.
    """
    token = _CURRENT.set(record)
    try:
        yield record
    finally:
        _CURRENT.reset(token)


def mark(
    phase: str,
    tree: PyTree,
    axis_name: str,
    *,
    split: Sequence[bool] | None = None,
    rows: bool = False,
) -> None:
    """Sends ``tree``'s per-leaf fingerprints to the observing :class:`Record`, if any.

    Args:
      phase: one of :data:`PHASES`.
      tree: the phase's output on this replica.
      axis_name: the data axis.
      split: per leaf, whether it is this replica's slice of a leaf split
        over the data axis (hashed at its global positions and summed over
        replicas, so the rows are the same for every layout); default the
        tree's per-replica leaves (:func:`jdp._layout.per_replica_leaves`).
      rows: the leaves are stacked rows (exact mode's virtual replicas),
        each hashed alone and summed, so where a row is computed does not
        change the sum.
    """
    record = _CURRENT.get()
    if record is None:
        return
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    record.names.setdefault(phase, [jax.tree_util.keystr(path) for path, _ in paths])
    leaves = [x for _, x in paths]
    split = _layout.per_replica_leaves(tree) if split is None else list(split)
    if rows:
        each = jax.vmap(lambda row: logical_hashes(row, split, axis_name))(leaves)
        hashes = jnp.sum(each, axis=0, dtype=jnp.uint32)
    else:
        hashes = logical_hashes(leaves, split, axis_name)
    jax.debug.callback(functools.partial(record.add, phase), lax.axis_index(axis_name), hashes)


def mark_gradients(
    phase: str,
    grads: PyTree,
    others: dict[str, PyTree],
    axis_name: str,
    *,
    split: Sequence[bool] | None = None,
    rows: bool = False,
) -> None:
    """:func:`mark` of ``{"grads": grads, **others}``; ``split`` gives the gradient leaves' flags."""
    if _CURRENT.get() is None:
        return
    structure = jax.tree.structure(grads)
    flags = [False] * len(jax.tree.leaves(grads)) if split is None else list(split)
    tree = {"grads": grads, **others}
    marks = {"grads": jax.tree.unflatten(structure, flags), **jax.tree.map(lambda _: False, others)}
    mark(phase, tree, axis_name, split=jax.tree.leaves(marks), rows=rows)


def mark_contribution(
    contribution: Any,
    axis_name: str,
    *,
    split: Sequence[bool] | None = None,
    rows: bool = False,
) -> None:
    """:func:`mark_gradients` of a :class:`jdp._forward.Contribution`: the forward/backward phase."""
    fields = contribution._asdict()
    grads = fields.pop("grads")
    mark_gradients(FORWARD, grads, fields, axis_name, split=split, rows=rows)

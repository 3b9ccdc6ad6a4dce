"""A step's phases seen from the host: fingerprints for :func:`jdp.verify.replay`, times for the pace.

A step marks the input and the output of each phase: its batch as it
starts, every replica's contributions after its forward and backward passes
(before any collective), the reduced result, the updated state. :func:`mark`
returns its tree unchanged unless the step is traced inside
:func:`observing`; there the observer sees the phase: a :class:`Record` adds
a ``jax.debug.callback`` that sends the phase's per-leaf fingerprints (the
hashes of :func:`jdp.metrics.leaf_fingerprints`) to the host, a
:class:`jdp._stamps.Clock` stamps the time the device reached it. Observers
return every value bit for bit; an ordinary step's graph holds none of
this. (An observed step is still another compilation: outside exact mode,
XLA may round a value of it differently; ``docs/multi-host.md``.)
"""

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _layout
from jdp._tree import PyTree
from jdp.metrics._fingerprint import logical_hashes

START = "start"  # the step's batch, as the step begins (timed, never fingerprinted)
FORWARD = "forward/backward"
REDUCTION = "reduction"
UPDATE = "update"
PHASES = (FORWARD, REDUCTION, UPDATE)  # the fingerprinted ones, in order
T = TypeVar("T")


class Observer(Protocol):
    """What a step traced inside :func:`observing` tells of each phase."""

    def observe(
        self, phase: str, tree: T, axis_name: str, split: list[bool], rows: bool
    ) -> T:  # pragma: no cover - a protocol
        """Sees ``tree``, the phase's value on one replica; returns it, bit for bit."""
        ...


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

    def observe(self, phase: str, tree: T, axis_name: str, split: list[bool], rows: bool) -> T:
        """Sends the phase's per-leaf fingerprints here (the start has none)."""
        if phase not in PHASES:
            return tree
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        self.names.setdefault(phase, [jax.tree_util.keystr(path) for path, _ in paths])
        leaves = [x for _, x in paths]
        if rows:
            each = jax.vmap(lambda row: logical_hashes(row, split, axis_name))(leaves)
            hashes = jnp.sum(each, axis=0, dtype=jnp.uint32)
        else:
            hashes = logical_hashes(leaves, split, axis_name)
        jax.debug.callback(functools.partial(self.add, phase), lax.axis_index(axis_name), hashes)
        return tree


_CURRENT: contextvars.ContextVar[Observer | None] = contextvars.ContextVar(
    "jdp_phases", default=None
)
Obs = TypeVar("Obs", bound=Observer)
C = TypeVar("C")


@contextlib.contextmanager
def observing(observer: Obs) -> Iterator[Obs]:
    """Steps traced inside show their phases to ``observer``.

    Tracing-time state that changes no result: it only adds callbacks.
    """
    token = _CURRENT.set(observer)
    try:
        yield observer
    finally:
        _CURRENT.reset(token)


def mark(
    phase: str,
    tree: T,
    axis_name: str,
    *,
    split: Sequence[bool] | None = None,
    rows: bool = False,
) -> T:
    """Shows ``tree`` to the observer, if any; use the tree it returns (the same bits).

    A :class:`jdp._stamps.Clock` ties the returned tree to its stamp, so what
    consumes it (the next phase) cannot start before the stamp.

    Args:
      phase: :data:`START` or one of :data:`PHASES`.
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
    observer = _CURRENT.get()
    if observer is None:
        return tree
    split = _layout.per_replica_leaves(tree) if split is None else list(split)
    return observer.observe(phase, tree, axis_name, split, rows)


def mark_gradients(
    phase: str,
    grads: PyTree,
    others: dict[str, PyTree],
    axis_name: str,
    *,
    split: Sequence[bool] | None = None,
    rows: bool = False,
) -> tuple[PyTree, dict[str, PyTree]]:
    """:func:`mark` of ``{"grads": grads, **others}``; ``split`` gives the gradient leaves' flags.

    Returns ``(grads, others)`` as the observer returned them.
    """
    if _CURRENT.get() is None:
        return grads, others
    structure = jax.tree.structure(grads)
    flags = [False] * len(jax.tree.leaves(grads)) if split is None else list(split)
    tree = {"grads": grads, **others}
    marks = {"grads": jax.tree.unflatten(structure, flags), **jax.tree.map(lambda _: False, others)}
    seen = mark(phase, tree, axis_name, split=jax.tree.leaves(marks), rows=rows)
    grads = seen.pop("grads")
    return grads, seen


def mark_contribution(
    contribution: C,
    axis_name: str,
    *,
    split: Sequence[bool] | None = None,
    rows: bool = False,
) -> C:
    """:func:`mark_gradients` of a :class:`jdp._forward.Contribution`: the forward/backward phase."""
    fields = contribution._asdict()  # type: ignore[attr-defined]
    grads = fields.pop("grads")
    grads, others = mark_gradients(FORWARD, grads, fields, axis_name, split=split, rows=rows)
    return contribution._replace(grads=grads, **others)  # type: ignore[attr-defined]

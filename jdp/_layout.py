"""State that a strategy places per replica: the one seam the core knows.

Replication, checkpoints and the backends treat every leaf as one logical
value held identically by each replica, except inside a :class:`PerReplica`
node: a pytree node whose replicas hold different parts of one logical value
(e.g. the optimizer state that :func:`jdp.strategies.zero1` splits). Such a
node says how to read its logical value, which of its leaves every replica
holds alike, and how to place a logical value the way it is placed itself.
The core calls these methods and never names a strategy.
"""

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

from jdp import _tree
from jdp._tree import PyTree

Replicate = Callable[[PyTree], PyTree]


@runtime_checkable
class PerReplica(Protocol):
    """A placed pytree node whose replicas hold different parts of one value."""

    def logical(self, read: Callable[[Any], Any]) -> PyTree:
        """The logical value on the host; ``read`` gives one copy of a replicated leaf."""
        ...

    def shared(self) -> PyTree:
        """The node with its per-replica leaves replaced by None (for in-sync checks)."""
        ...

    def place_like(self, value: PyTree, replicate: Replicate) -> "PerReplica":
        """``value`` (a logical value) placed as this node is; ``replicate`` for shared leaves."""
        ...


def is_per_replica(x: object) -> bool:
    return isinstance(x, PerReplica)


def has_per_replica(tree: PyTree) -> bool:
    return any(is_per_replica(x) for x in jax.tree.leaves(tree, is_leaf=is_per_replica))


def logical(tree: PyTree, read: Callable[[Any], Any]) -> PyTree:
    """Every leaf through ``read``; per-replica nodes as their logical value."""
    return jax.tree.map(
        lambda x: x.logical(read) if is_per_replica(x) else read(x), tree, is_leaf=is_per_replica
    )


def shared(tree: PyTree) -> PyTree:
    """``tree`` without the leaves that differ between replicas by design."""
    return jax.tree.map(
        lambda x: x.shared() if is_per_replica(x) else x, tree, is_leaf=is_per_replica
    )


def place_like(template: PyTree, value: PyTree, replicate: Replicate) -> PyTree:
    """``value`` (logical, one copy) placed like ``template``.

    Per-replica nodes of ``template`` place their part of ``value`` themselves;
    everything else goes through ``replicate`` in one call.
    """
    nodes = jax.tree.leaves(template, is_leaf=is_per_replica)
    if not any(is_per_replica(x) for x in nodes):
        return replicate(value)
    structure = _tree.structure(template, is_leaf=is_per_replica)
    parts = structure.flatten_up_to(value)
    holes = [None if is_per_replica(t) else p for t, p in zip(nodes, parts, strict=True)]
    placed = structure.flatten_up_to(replicate(structure.unflatten(holes)))
    out = [
        t.place_like(p, replicate) if is_per_replica(t) else q
        for t, p, q in zip(nodes, parts, placed, strict=True)
    ]
    return structure.unflatten(out)


def per_replica_leaves(tree: PyTree) -> list[bool]:
    """Per leaf of ``tree`` (in flatten order): whether each replica holds its own part.

    Read from the structure alone (it works on tracers): a per-replica node
    marks the leaves its :meth:`PerReplica.shared` leaves out.
    """
    out: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=is_per_replica):
        if is_per_replica(node):
            kept = jax.tree.leaves(node.shared(), is_leaf=lambda x: x is None)
            out.extend(x is None for x in kept)
        else:
            out.append(False)
    return out

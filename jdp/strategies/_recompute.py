"""Exact mode's recomputation check: a device that computes wrong is named.

In exact mode a virtual replica's contribution (its gradients, loss, model
state and aux) is a fixed function of its examples, the same bits on any
device. So every ``every`` steps, each device also computes one virtual
replica of its left neighbour's (chosen by rotation), and the two
computations' hashes are compared (one small all-gather). Where they
differ, each device computes its second-left neighbour's the same way (a
second small all-gather), and
the odd one out of the three is named: the owner (whose wrong gradients went
into the update) or the recomputing device. With two devices the third
computation runs on the owner again; with one, every computation does.

The step's ``recompute`` metric is ``[step, virtual replica, owner,
recomputer, arbiter, odd, leaf]`` (int32, the same on every device):
``virtual replica`` is -2 on a step not checked and -1 where every check
agreed; else the first virtual replica whose computations differed, the
devices that made them (data-axis indices), ``odd`` the one that differs
from the other two (-1: no two agree), and ``leaf`` the first gradient leaf
that differs (the number of gradient leaves: the loss, model state or aux).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jdp._tree import PyTree
from jdp.metrics._fingerprint import leaf_hashes

NOT_CHECKED, AGREED = -2, -1
WIDTH = 7  # the metric's length


class Extra(NamedTuple):
    """The rows a device computes beyond its own on a checked step."""

    micro: PyTree  # (2, B/G, ...): its left and second-left neighbour's checked micro-batch
    virtual_replicas: jax.Array  # (2,) their global indices
    checked: jax.Array  # bool: this device's step count is a multiple of every
    step: jax.Array  # the step checked: state.step after it
    row: jax.Array  # which of its own rows each device has checked


def plan(
    step: jax.Array, every: int, micro: PyTree, per_device: int, axis_name: str, due: bool | None
) -> Extra:
    """This step's check: whether it runs, which rows, and the neighbours' micro-batches.

    ``due``: True where the host chose this step for the check
    (:mod:`jdp._schedule`); None where each device decides from its own
    step count. No collective depends on that decision, so devices that
    disagree (a step count hit by a fault) cannot wait on each other.
    """
    n = lax.axis_size(axis_name)
    after = (step + 1).astype(jnp.int32)
    row = (after // every) % per_device
    mine = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, row, keepdims=True), micro)
    moved = [lax.ppermute(mine, axis_name, [(i, (i + k) % n) for i in range(n)]) for k in (1, 2)]
    device = lax.axis_index(axis_name)
    theirs = jnp.stack([((device - k) % n) * per_device + row for k in (1, 2)]).astype(jnp.int32)
    both = jax.tree.map(lambda *x: jnp.concatenate(x), *moved)
    checked = (after % every == 0) if due is None else jnp.asarray(True)
    return Extra(both, theirs, checked, after, row)


def skipped(step: jax.Array) -> jax.Array:
    """The metric of a step the host chose not to check: ``[step after it, -2, ...]``."""
    after = (step + 1).astype(jnp.int32)
    return jnp.stack([after, *[jnp.int32(NOT_CHECKED)] * (WIDTH - 1)])


def hashes(contribution: PyTree) -> jax.Array:
    """``(gradient leaves + 1, 2)`` uint32: each gradient leaf's hash, then the rest's.

    The rest (loss, weight, model state, aux) is one row: its leaves' hashes
    summed, which a single flipped bit still changes (each leaf's hash
    changes by an odd multiple of a power of two).
    """
    rest = jnp.sum(leaf_hashes(tuple(contribution)[1:]), axis=0, dtype=jnp.uint32)
    return jnp.concatenate([leaf_hashes(contribution.grads), rest[None]])


def check(
    extra: Extra,
    buffers: PyTree,
    arbitrate: Callable[[PyTree, jax.Array], PyTree],
    per_device: int,
    axis_name: str,
) -> tuple[PyTree, jax.Array]:
    """``(buffers, the recompute metric)``, after the third computation where a check failed.

    ``buffers`` holds this device's rows: its own, then its left
    neighbour's recomputed (row ``per_device``); ``arbitrate(buffers,
    failed)`` computes its second-left neighbour's into row
    ``per_device + 1`` where ``failed`` (on every device alike).

    No collective sits inside a ``lax.cond``: on XLA:CPU a branch holding
    one cost about 10 ms a step on the bench MLP even when not taken
    (measured at 8 devices), so the two tiny all-gathers run every step and
    only the hashing is conditional.
    """
    n = lax.axis_size(axis_name)
    row = lambda i, b: jax.tree.map(lambda x: x[i], b)  # noqa: E731
    width = len(jax.tree.leaves(buffers.grads)) + 1

    def pair() -> jax.Array:
        return jnp.stack([hashes(row(extra.row, buffers)), hashes(row(per_device, buffers))])

    blank = jnp.zeros((2, width, 2), jnp.uint32)
    first = lax.all_gather(lax.cond(extra.checked, pair, lambda: blank), axis_name)
    by_owner = jnp.stack([first[:, 0], jnp.roll(first[:, 1], -1, axis=0)], axis=1)
    differs = jnp.any(by_owner[:, 0] != by_owner[:, 1], axis=-1)  # (n, leaves)
    failed = extra.checked & jnp.any(differs)
    owner = jnp.argmax(jnp.any(differs, axis=1)).astype(jnp.int32)
    leaf = jnp.argmax(differs[owner]).astype(jnp.int32)
    buffers = arbitrate(buffers, failed)
    third = lax.cond(failed, lambda: hashes(row(per_device + 1, buffers)), lambda: blank[0])
    arbiter = jnp.roll(lax.all_gather(third, axis_name), -2, axis=0)[owner]
    with_owner = jnp.all(arbiter == by_owner[owner, 0])
    with_recomputer = jnp.all(arbiter == by_owner[owner, 1])
    odd = jnp.where(with_owner, (owner + 1) % n, jnp.where(with_recomputer, owner, -1))
    devices = [owner, (owner + 1) % n, (owner + 2) % n]
    found = jnp.stack([extra.step, owner * per_device + extra.row, *devices, odd, leaf])
    code = jnp.where(extra.checked, AGREED, NOT_CHECKED)
    quiet = jnp.stack([extra.step, *[code] * (WIDTH - 1)]).astype(jnp.int32)
    return buffers, jnp.where(failed, found.astype(jnp.int32), quiet)

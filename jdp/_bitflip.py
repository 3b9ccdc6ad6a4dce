"""Flipping one bit inside a step, for the fault injector (testing only).

:mod:`jdp._faults` flips a bit of a replica's new state; exact mode flips a
bit of one device's gradient for one virtual replica when the step's batch
arrives as a :class:`FaultedBatch` (built by ``jdp.testing.with_faults(...,
target="gradients")``, never by training code).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jdp._tree import PyTree

# A fault spec's fields, in the order of its int32 row.
FIELDS = ("step", "replica", "leaf", "index", "bit", "virtual_replica")


@dataclasses.dataclass(frozen=True)
class FaultedBatch:
    """A step's batch with a gradient fault's spec (not a pytree: it lives inside one trace)."""

    data: PyTree
    spec: jax.Array  # (len(FIELDS),) int32


def flipped(x: jax.Array, hit: jax.Array, index: jax.Array, bit: jax.Array) -> jax.Array:
    """``x`` with bit ``bit`` of flat element ``index`` (both modulo its size) flipped where ``hit``."""
    width = 8 * x.dtype.itemsize
    unsigned = jnp.dtype(f"uint{width}")
    words = lax.bitcast_convert_type(x, unsigned).reshape(-1)
    at = index % words.size
    mask = jnp.left_shift(jnp.ones((), unsigned), (bit % width).astype(unsigned))
    words = words.at[at].set(jnp.where(hit, words[at] ^ mask, words[at]))
    return lax.bitcast_convert_type(words.reshape(x.shape), x.dtype)


def flip_rows(
    stacked: PyTree, rows: jax.Array, spec: jax.Array, step: jax.Array, axis_name: str
) -> PyTree:
    """Stacked per-virtual-replica gradients with the fault's bit flipped in its row.

    ``rows`` gives each row's global virtual replica, or -1 for a row not
    computed in this pass; the row hit is the one this device computed for
    the fault's virtual replica, when this device is its ``replica``.
    """
    at_step, replica, leaf, index, bit, virtual_replica = (spec[i] for i in range(len(FIELDS)))
    here = (step == at_step) & (lax.axis_index(axis_name) == replica)
    leaves, treedef = jax.tree.flatten(stacked)
    out = []
    for i, x in enumerate(leaves):
        hit = here & (leaf == i) & (rows == virtual_replica)  # (rows,)
        out.append(jax.vmap(lambda r, h: flipped(r, h, index, bit))(x, hit))
    return jax.tree.unflatten(treedef, out)

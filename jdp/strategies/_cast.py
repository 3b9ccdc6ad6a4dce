"""Gradient communication in a narrower dtype (bfloat16 by default).

What PyTorch DDP's ``bf16_compress_hook`` and DeepSpeed's communication dtype
do: floating gradients are cast down before the all-reduce or reduce-scatter
and cast back after it, so the collectives move half the bytes of float32;
local accumulation, the division by the total weight and the update stay in
the gradients' own dtype. The sum over replicas is rounded to ``dtype``, so
the update is no longer bitwise that of the float32 all-reduce.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jdp._tree import PyTree
from jdp.strategies._base import Communication


def cast_communication(dtype: DTypeLike = jnp.bfloat16) -> Communication:
    """Collectives that move floating gradients in ``dtype``.

    Pass it to :func:`jdp.strategies.data_parallel` or
    :func:`jdp.strategies.zero1` as ``communication=``. Leaves that are not
    floating, or already no wider than ``dtype``, travel as they are.

    Args:
      dtype: a floating dtype, e.g. ``jnp.bfloat16``; ``jnp.float16`` only
        with a loss scale (its sums overflow above 65504, and a loss scale
        skips such steps; without one the step is refused).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> comm = jdp.strategies.cast_communication(jnp.bfloat16)
      >>> strategy = jdp.strategies.data_parallel(communication=comm)
      >>> strategy.name
      'data_parallel'
    """
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # not a dtype at all ("fp16")
        floating = False
    if not floating:
        raise TypeError(
            f"jdp.strategies.cast_communication: dtype must be floating (e.g. jnp.bfloat16), "
            f"got {dtype!r}."
        )
    narrow = jnp.dtype(dtype)

    def down(x: jax.Array) -> jax.Array:
        wider = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > narrow.itemsize
        return x.astype(narrow) if wider else x

    def all_reduce(tree: PyTree, axis_name: str) -> PyTree:
        summed = lax.psum(jax.tree.map(down, tree), axis_name)
        return jax.tree.map(lambda s, x: s.astype(x.dtype), summed, tree)

    def reduce_scatter(rows: list[jax.Array], axis_name: str) -> list[jax.Array]:
        return [
            lax.psum_scatter(down(x), axis_name, scatter_dimension=0).astype(x.dtype) for x in rows
        ]

    return Communication(all_reduce, reduce_scatter, narrow)

"""Weighted losses: the one rule that makes every data-parallel step exact.

Each replica (and each micro-batch) contributes the gradient of its *summed*
loss and its weight; both are all-reduced and divided once. The update is
then the gradient of ``sum(totals) / sum(weights)`` over the whole global
batch: per-example losses, per-token losses and padding alike.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _tree
from jdp import _tree as pytree
from jdp._tree import PyTree


@pytree.dataclass
class WeightedLoss:
    """A replica's summed loss and its weight.

    Return it from a loss function (alone, or in place of the scalar loss in
    any of the forms :func:`jdp.make_train_step` documents) to say "this
    replica's loss summed over ``weight`` units" (real examples, tokens, any
    non-negative weight). The step then follows the gradient of
    ``sum(totals) / sum(weights)`` over every replica and micro-batch. A
    replica of weight 0 contributes exactly nothing, even when ``total`` is
    NaN.

    Attributes:
      total: the summed loss, a floating scalar.
      weight: what ``total`` is summed over, a non-negative scalar.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> loss = jdp.WeightedLoss(total=jnp.float32(6.0), weight=jnp.float32(4.0))
      >>> float(loss.mean())
      1.5
    """

    total: jax.Array
    weight: jax.Array

    def __post_init__(self) -> None:
        # A traced weight cannot be checked here; a negative one makes the
        # step NaN (zero_where_weightless). A concrete one is refused at once.
        for name in ("total", "weight"):
            value = getattr(self, name)
            dtype = getattr(value, "dtype", None) or np.asarray(value).dtype
            if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
                raise TypeError(
                    f"jdp.WeightedLoss.{name} must be a number or numeric array (a sum of "
                    f"losses, and what it sums over), got {value!r:.60}."
                )
        weight = self.weight
        if not isinstance(weight, jax.core.Tracer) and np.any(np.asarray(weight) < 0):
            raise ValueError(
                f"jdp.WeightedLoss.weight must be >= 0 (what the total is summed over), got "
                f"{np.asarray(weight)}; a negative weight would drop this replica's update."
            )

    def mean(self) -> jax.Array:
        """``total / weight``, or 0 where the weight is 0."""
        return safe_divide(self.total, self.weight)


def weighted_mean(values: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None):
    """Per-example or per-token values and a mask, as a :class:`WeightedLoss`.

    The total is the sum of ``values`` where ``mask`` is nonzero (multiplied
    by ``mask`` when it holds weights rather than booleans); the weight is the
    sum of the mask over every value it covers. A mask of shape ``(B,)`` over
    values of shape ``(B, T)`` weights every token of a real example; a
    ``(B, T)`` mask weights tokens one by one. Masked-out values never reach
    the total, so padding that computes NaN is harmless.

    Args:
      values: the loss of every example (or token), shape ``(B, ...)``.
      mask: booleans or non-negative weights whose shape is a prefix of
        ``values.shape``; None counts every value once.

    Returns:
      ``WeightedLoss(total, weight)`` in float32.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> loss = jdp.weighted_mean(jnp.array([1.0, 3.0, jnp.nan]), jnp.array([True, True, False]))
      >>> float(loss.total), float(loss.weight), float(loss.mean())
      (4.0, 2.0, 2.0)
    """
    values = jnp.asarray(values).astype(jnp.float32)
    if mask is None:
        return WeightedLoss(jnp.sum(values), jnp.float32(values.size))
    mask = jnp.asarray(mask)
    if values.shape[: mask.ndim] != mask.shape:
        raise ValueError(
            f"jdp.weighted_mean: the mask's shape {mask.shape} must be a prefix of the values' "
            f"shape {values.shape} (one weight per example, or per token)."
        )
    weights = jnp.broadcast_to(
        mask.astype(jnp.float32).reshape(mask.shape + (1,) * (values.ndim - mask.ndim)),
        values.shape,
    )
    total = jnp.sum(jnp.where(weights > 0, values * weights, 0.0))
    return WeightedLoss(total, jnp.sum(weights))


def safe_divide(total: jax.Array, weight: jax.Array) -> jax.Array:
    """``total / weight`` where ``weight > 0``, exactly 0 where it is 0, NaN where negative.

    A negative weight can only be a traced one (``WeightedLoss`` refuses the
    others): NaN says so, where 0 would read as a replica without examples.
    """
    positive = weight > 0
    none = jnp.where(weight < 0, jnp.nan, 0.0)  # weakly typed: keeps total's dtype
    return jnp.where(positive, total / jnp.where(positive, weight, 1), none)


def zero_where_weightless(tree: PyTree, weight: jax.Array | None) -> PyTree:
    """Exact zeros in place of ``tree`` when ``weight`` is 0 (even over NaN).

    A negative weight (traced, so ``WeightedLoss`` could not refuse it) gives
    NaN in place of floating leaves: the step's loss and gradients turn NaN,
    which a loss scale skips and :func:`jdp.fit` reports, instead of the
    replica's data being dropped without a word.
    """
    if weight is None:
        return tree

    def one(x):
        none = jnp.zeros_like(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            none = jnp.where(weight < 0, jnp.full_like(x, jnp.nan), none)
        return jnp.where(weight > 0, x, none)

    return jax.tree.map(one, tree)


def weighted_average(tree: PyTree, weight: jax.Array | None, axis_name: str) -> PyTree:
    """The across-replica average of ``tree``'s floating leaves, weighted by ``weight``.

    ``weight=None`` means equal weights (``lax.pmean``). Replicas of weight 0
    have no say; where every weight is 0 each replica keeps its own values.
    Integer leaves pass through.
    """
    leaves, treedef = _tree.flatten(tree)
    index = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    own = [leaves[i] for i in index]
    if not own:
        return tree
    if weight is None:
        averaged = lax.pmean(own, axis_name)
    else:
        weighted = [zero_where_weightless(x * weight.astype(x.dtype), weight) for x in own]
        sums, total = lax.psum((weighted, weight), axis_name)
        averaged = [
            jnp.where(total > 0, safe_divide(s, total.astype(s.dtype)), x)
            for s, x in zip(sums, own, strict=True)
        ]
    for i, x in zip(index, averaged, strict=True):
        leaves[i] = x
    return treedef.unflatten(leaves)

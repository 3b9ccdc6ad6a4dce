"""Loss scales: scale the loss, unscale the gradients, adapt to overflows.

Names and semantics follow jmp (``loss_scale``, ``counter``, ``period``,
``factor``, ``min_loss_scale``; ``scale``, ``unscale``, ``adjust``), so jmp
users port by changing an import. Each scale is an immutable pytree: the
current scale and counter are leaves, the hyperparameters are static fields,
and every field survives ``jit``, ``pmap``, ``replicate`` and checkpoints.
"""

import math
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from jdp import _tree as pytree
from jdp._args import check_int
from jdp._tree import PyTree


def all_finite(tree: PyTree) -> jax.Array:
    """True when every floating leaf of ``tree`` is free of inf and NaN.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> bool(jdp.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not checks:
        return jnp.array(True)
    return jnp.all(jnp.stack(checks))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_scale(name: str, value) -> None:
    if isinstance(value, str | bytes):  # np.asarray("1024") would read it as a number
        raise TypeError(f"{name} must be a number, got {value!r}.")
    if _is_concrete(value):
        v = float(np.asarray(value))
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be finite and > 0, got {v}.")


def _scale_tree(tree: PyTree, factor: jax.Array) -> PyTree:
    # In float32 whatever the leaf dtype, as jmp does: a float16 leaf times a
    # float32 scale promotes, while casting the scale to float16 would turn
    # 65536 into inf.
    def scale(x):
        return jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32)) * factor

    return jax.tree.map(scale, tree)


def _unscale_tree(tree: PyTree, factor: jax.Array) -> PyTree:
    # Divide in float32 and cast back, so float16 leaves lose nothing extra;
    # integer leaves are not gradients and pass through.
    def unscale(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return x
        return (jnp.asarray(x, jnp.float32) / factor).astype(jnp.result_type(x))

    return jax.tree.map(unscale, tree)


@pytree.dataclass
class NoOpLossScale:
    """No loss scaling: the step never skips an update.

    Example:
      >>> import jdp
      >>> jdp.NoOpLossScale().scale(2.0)
      2.0
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: PyTree) -> PyTree:
        return tree

    def unscale(self, tree: PyTree) -> PyTree:
        return tree

    def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
        del grads_finite
        return self


@pytree.dataclass
class StaticLossScale:
    """A fixed loss scale; steps with non-finite gradients are skipped.

    Args:
      loss_scale: the factor the loss is multiplied by, finite and > 0.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> s = jdp.StaticLossScale(1024)
      >>> float(s.unscale(s.scale(jnp.float32(3.0))))
      3.0
    """

    loss_scale: jax.Array

    def __post_init__(self):
        _check_scale("jdp.StaticLossScale.loss_scale", self.loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(self.loss_scale, jnp.float32))

    def scale(self, tree: PyTree) -> PyTree:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        del grads_finite
        return self


@pytree.dataclass
class DynamicLossScale:
    """A loss scale that grows after ``period`` finite steps and shrinks on overflow.

    The rule, exactly: on a finite step the counter advances, and the step
    that completes ``period`` consecutive finite steps multiplies the scale by
    ``factor`` (only if the result is finite) and resets the counter. On a
    non-finite step the scale is divided by ``factor``, never going below
    ``min_loss_scale``, and the counter resets.

    Args:
      loss_scale: the initial scale, finite and > 0 (jmp and Flax start at
        ``2**15``).
      counter: consecutive finite steps so far, >= 0.
      period: finite steps between increases, >= 1 (static).
      factor: growth and shrink factor, > 1 (static).
      min_loss_scale: the floor for the scale, finite and > 0 (static).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> s = jdp.DynamicLossScale(jnp.float32(2**15), period=2)
      >>> s = s.adjust(jnp.array(True)).adjust(jnp.array(True))
      >>> float(s.loss_scale), int(s.counter)
      (65536.0, 0)
      >>> float(s.adjust(jnp.array(False)).loss_scale)
      32768.0
    """

    loss_scale: jax.Array
    counter: jax.Array | int = 0
    period: int = pytree.static_field(default=2000)
    factor: int | float = pytree.static_field(default=2)
    min_loss_scale: float = pytree.static_field(default=1.0)

    def __post_init__(self):
        _check_scale("jdp.DynamicLossScale.loss_scale", self.loss_scale)
        _check_scale("jdp.DynamicLossScale.min_loss_scale", self.min_loss_scale)
        check_int(self.period, "period", minimum=1, where="jdp.DynamicLossScale")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
            raise TypeError(f"jdp.DynamicLossScale.factor must be a number, got {self.factor!r}.")
        if not (math.isfinite(self.factor) and self.factor > 1):
            raise ValueError(
                f"jdp.DynamicLossScale.factor must be finite and > 1, got {self.factor}."
            )
        if _is_concrete(self.counter) and int(np.asarray(self.counter)) < 0:
            raise ValueError(f"jdp.DynamicLossScale.counter must be >= 0, got {self.counter}.")
        if _is_concrete(self.loss_scale) and self.min_loss_scale > float(
            np.asarray(self.loss_scale)
        ):
            raise ValueError(
                f"jdp.DynamicLossScale: min_loss_scale={self.min_loss_scale} is above the initial "
                f"loss_scale={float(np.asarray(self.loss_scale))}; the floor would make the "
                "scale grow on overflow. Lower min_loss_scale or raise loss_scale."
            )
        object.__setattr__(self, "loss_scale", jnp.asarray(self.loss_scale, jnp.float32))
        object.__setattr__(self, "counter", jnp.asarray(self.counter, jnp.int32))
        object.__setattr__(self, "min_loss_scale", float(self.min_loss_scale))

    def scale(self, tree: PyTree) -> PyTree:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """The scale after a step whose reduced gradients were (not) finite.

        Args:
          grads_finite: a boolean scalar, the same on every replica
            (:func:`jdp.all_finite` of the reduced gradients).
        """
        _check_decision(grads_finite)
        counter = self.counter + 1
        complete = counter >= self.period
        grown = self.loss_scale * self.factor
        grown = jnp.where(complete & jnp.isfinite(grown), grown, self.loss_scale)
        shrunk = jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale)
        loss_scale = jnp.where(grads_finite, grown, shrunk).astype(jnp.float32)
        counter = jnp.where(grads_finite & ~complete, counter, 0).astype(jnp.int32)
        return pytree.replace(self, loss_scale=loss_scale, counter=counter)


LossScale: TypeAlias = NoOpLossScale | StaticLossScale | DynamicLossScale
"""Any of the three loss scales; what ``TrainState.loss_scale`` holds."""


def _check_decision(grads_finite: jax.typing.ArrayLike) -> None:
    """jmp asserts a boolean scalar here; a vector would turn the scale into a vector."""
    shape, dtype = jnp.shape(grads_finite), jnp.result_type(grads_finite)
    if shape != () or dtype != jnp.bool_:
        raise ValueError(
            "jdp.DynamicLossScale.adjust: grads_finite must be one boolean scalar (one decision "
            f"for the whole step), got shape {shape} and dtype {dtype}. Reduce it first, e.g. "
            "jdp.all_finite(grads)."
        )

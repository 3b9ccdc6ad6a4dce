"""The update: apply reduced gradients once, identically on every replica."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import _tree
from jdp._loss_scale import NoOpLossScale, all_finite
from jdp._state import TrainState
from jdp._tree import PyTree


def apply_gradients(
    state: TrainState,
    grads: PyTree,
    *,
    model_state: PyTree = None,
    axis_name: str | None = None,
    global_norm: Callable[[PyTree], jax.Array] | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """Applies all-reduced, unscaled gradients; skips the update where they are not finite.

    The tail of every jdp step, exported for custom steps. It runs
    ``state.tx``; with a static or dynamic loss scale it decides once whether
    ``grads`` are finite (identical on every replica, since they were
    all-reduced), keeps params, optimizer state and model state bit-for-bit
    unchanged on a skipped step, counts it in ``skipped_steps`` and adjusts
    the loss scale. The step counter always advances.

    Args:
      state: the state before the step.
      grads: the reduced gradients, already unscaled
        (``state.loss_scale.unscale(...)``).
      model_state: the new model state, or None to keep ``state.model_state``.
      axis_name: when each replica holds only a slice of the gradients (a
        sharded optimizer), the data axis over which the replicas agree on
        whether the gradients are finite; None when every replica holds them all.
      global_norm: passed to ``state.tx.update`` as the extra argument
        ``global_norm`` (optax's ``GradientTransformationExtraArgs``), read by
        :func:`jdp.clip_by_global_norm`; a strategy whose replicas hold slices
        passes the norm over every replica's slices. None: the plain norm.

    Returns:
      ``(new_state, metrics)``; metrics hold ``grads_finite``, ``loss_scale``
      (the scale this step used) and ``skipped_steps`` unless the loss scale
      is a :class:`jdp.NoOpLossScale`.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> state = jdp.TrainState.create(params=jnp.ones(2), tx=optax.sgd(1.0),
      ...                               loss_scale=jdp.StaticLossScale(2.0**10))
      >>> new, m = jdp.apply_gradients(state, jnp.array([1.0, jnp.inf]))
      >>> new.params.tolist(), bool(m["grads_finite"]), int(new.skipped_steps)
      ([1.0, 1.0], False, 1)
    """
    _check_like_params(grads, state.params)
    if model_state is None:
        model_state = state.model_state
    if global_norm is None:
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    else:
        tx = optax.with_extra_args_support(state.tx)
        updates, opt_state = tx.update(
            grads, state.opt_state, state.params, global_norm=global_norm
        )
    params = optax.apply_updates(state.params, updates)
    if isinstance(state.loss_scale, NoOpLossScale):
        new = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state
        )
        return new, {}
    finite = all_finite(grads)
    if axis_name is not None:  # every replica checked its own slice: one decision for all
        finite = lax.pmin(finite.astype(jnp.int32), axis_name) > 0
    params, opt_state, model_state = jax.tree.map(
        lambda new, old: lax.select(finite, new, old),
        (params, opt_state, model_state),
        (state.params, state.opt_state, state.model_state),
    )
    skipped_steps = state.skipped_steps + (~finite).astype(jnp.int32)
    new = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        model_state=model_state,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=skipped_steps,
    )
    metrics = {
        "grads_finite": finite,
        "loss_scale": state.loss_scale.loss_scale,
        "skipped_steps": skipped_steps,
    }
    return new, metrics


def _check_like_params(grads: PyTree, params: PyTree) -> None:
    # optax would fail on the first mismatched node with a bare pytree error.
    got, expected = _tree.structure(grads), _tree.structure(params)
    if got != expected:
        raise ValueError(
            "jdp.apply_gradients: grads must have the structure of state.params (one gradient "
            f"per parameter leaf, e.g. jax.grad(loss_fn)(state.params, ...)); got {got!s:.200}, "
            f"expected {expected!s:.200}."
        )

"""The per-replica training step and its composable pieces.

Nothing here knows which backend runs it: the step uses only collectives
over ``axis_name``, so ``jdp.pmap`` and ``jdp.shard_map`` wrap it unchanged.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp.loss_scale import NoOpLossScale, all_finite
from jdp.sharding import AXIS_NAME, batch_size
from jdp.state import TrainState
from jdp.types import PyTree

MASK_KEY = "mask"
RESERVED_METRICS = ("loss", "grads_finite", "loss_scale", "skipped_steps")
GRAD_REDUCTIONS = ("mean", "sum")

Step = Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The mean of ``values`` over the examples where ``mask`` is True.

    Zero when there are none, so a replica holding only padding contributes
    nothing. With ``mask=None``, the plain mean.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> float(jdp.masked_mean(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False])))
      2.0
    """
    if mask is None:
        return jnp.mean(values)
    mask = mask.astype(values.dtype).reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
    count = jnp.sum(mask) * (values.size // max(mask.size, 1))
    return jnp.sum(values * mask) / jnp.maximum(count, 1)


def replica_rng(key: jax.Array, step: jax.Array, axis_name: str = AXIS_NAME) -> jax.Array:
    """A key distinct per replica and step, deterministic in (key, step, replica).

    Use inside a step, under a backend that binds ``axis_name``.
    """
    return jax.random.fold_in(jax.random.fold_in(key, step), lax.axis_index(axis_name))


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """Casts the floating leaves of ``tree`` to ``dtype``; others pass through."""
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def reduce_gradients(
    grads: PyTree,
    axis_name: str,
    grad_reduce: str,
    count: jax.Array | None = None,
) -> PyTree:
    """All-reduces per-replica gradients.

    Args:
      grads: this replica's gradient (with ``count``: the count-weighted sum).
      axis_name: the data axis.
      grad_reduce: ``"mean"``, the gradient of the mean loss over the global
        batch; ``"sum"``, the sum of per-replica gradients (Chainer's
        ``addgrads``, Caffe2's all-reduce).
      count: this replica's number of real examples when the batch carries a
        mask; replicas are then weighted by it.
    """
    if count is None:
        reduce = lax.pmean if grad_reduce == "mean" else lax.psum
        return reduce(grads, axis_name)
    if grad_reduce == "mean":
        total = jnp.maximum(lax.psum(count, axis_name), 1.0)
        return jax.tree.map(lambda g: g / total.astype(g.dtype), lax.psum(grads, axis_name))
    local = jnp.maximum(count, 1.0)
    return lax.psum(jax.tree.map(lambda g: g / local.astype(g.dtype), grads), axis_name)


def average_model_state(model_state: PyTree, axis_name: str) -> PyTree:
    """Averages floating model state (e.g. batch-norm statistics) across replicas."""
    return jax.tree.map(
        lambda x: lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        model_state,
    )


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    axis_name: str = AXIS_NAME,
    grad_reduce: str = "mean",
    has_aux: bool = False,
    has_model_state: bool = False,
    has_rng: bool = False,
    accumulate_steps: int = 1,
    compute_dtype: Any = None,
) -> Step:
    """Builds a pure per-replica step ``(state, batch) -> (state, metrics)``.

    The step computes this replica's loss under ``state.loss_scale``, takes
    gradients, all-reduces them over ``axis_name``, unscales them, decides
    once whether they are finite, and applies ``state.tx`` identically on
    every replica. Wrap it with :func:`jdp.pmap` or :func:`jdp.shard_map`.

    The loss function is called as ``loss_fn(params, batch, **extra)`` and
    returns:

    ====================  ==========================  =====================================
    has_model_state       has_aux                     returns
    ====================  ==========================  =====================================
    False                 False                       ``loss``
    False                 True                        ``(loss, aux)``
    True                  False                       ``(loss, new_model_state)``
    True                  True                        ``(loss, (new_model_state, aux))``
    ====================  ==========================  =====================================

    ``extra`` holds ``model_state=state.model_state`` when ``has_model_state``
    and ``rng=<this replica's key>`` when ``has_rng``. ``loss`` is a scalar,
    the mean over this replica's examples (use :func:`jdp.masked_mean` when
    the batch carries a ``"mask"``); ``aux`` is a dict of arrays that joins
    the metrics.

    Args:
      loss_fn: the loss, as above.
      axis_name: the data axis the backend binds.
      grad_reduce: ``"mean"`` (equals single-device training on the global
        batch) or ``"sum"`` (sum of per-replica gradients, the seeds' rule).
      has_aux: the loss also returns a dict of metrics.
      has_model_state: the loss takes and returns mutable model state.
      has_rng: the loss takes a per-replica, per-step PRNG key.
      accumulate_steps: split each replica's batch into this many
        micro-batches, accumulate their gradients locally and all-reduce once.
      compute_dtype: e.g. ``jnp.bfloat16``: floating params and batch leaves
        are cast for the forward and backward pass; master params, optimizer
        state, the all-reduce and the update stay in their own dtype.

    Returns:
      The step. Its metrics hold ``loss`` (this replica's, float32) and the
      aux entries; with a static or dynamic loss scale also ``grads_finite``,
      ``loss_scale`` (the scale this step used) and ``skipped_steps``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jdp
      >>> def loss_fn(params, batch):
      ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
      >>> state = jdp.TrainState.create(params={"w": jnp.zeros((3, 1))}, tx=optax.sgd(0.1))
      >>> train_step = jdp.pmap(jdp.make_train_step(loss_fn))
      >>> state = jdp.replicate(state)
      >>> batch = {"x": np.ones((16, 3), np.float32), "y": np.ones((16, 1), np.float32)}
      >>> state, metrics = train_step(state, jdp.shard(batch))
      >>> metrics["loss"].shape
      (8,)
    """
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn must be callable, got {loss_fn!r}.")
    if grad_reduce not in GRAD_REDUCTIONS:
        raise ValueError(
            f"make_train_step: unknown grad_reduce={grad_reduce!r}; expected one of "
            f"{GRAD_REDUCTIONS} ('mean': single-device semantics on the global "
            "batch; 'sum': sum of per-replica gradients)."
        )
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int):
        raise TypeError(
            f"make_train_step: accumulate_steps must be an int, got {accumulate_steps!r}."
        )
    if accumulate_steps < 1:
        raise ValueError(f"make_train_step: accumulate_steps must be >= 1, got {accumulate_steps}.")
    if compute_dtype is not None and not jnp.issubdtype(compute_dtype, jnp.floating):
        raise TypeError(
            f"make_train_step: compute_dtype must be a floating dtype such as "
            f"jnp.bfloat16, got {compute_dtype!r}."
        )

    def local_loss_and_grads(state, params, model_state, batch, rng):
        def scaled_loss(p):
            extra = {}
            if has_model_state:
                extra["model_state"] = model_state
            if has_rng:
                extra["rng"] = rng
            out = loss_fn(
                cast_floating(p, compute_dtype), cast_floating(batch, compute_dtype), **extra
            )
            loss, new_model_state, aux = _unpack(out, has_aux, has_model_state)
            loss = jnp.asarray(loss).astype(jnp.float32)
            return state.loss_scale.scale(loss), (loss, new_model_state, aux)

        (_, (loss, new_model_state, aux)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(
            params
        )
        return grads, loss, new_model_state, aux

    def accumulate(state, batch, size, rng):
        """This replica's gradient, loss, model state, aux and real-example count.

        With a mask the gradient is count-weighted (a sum over micro-batches
        of count x mean gradient) and the count is returned for the
        all-reduce; without one it is the plain mean and the count is None.
        """
        params, model_state = state.params, state.model_state
        if accumulate_steps == 1:
            grads, loss, model_state, aux = local_loss_and_grads(
                state, params, model_state, batch, rng
            )
            count = _count(batch)
            return _weigh(grads, count), loss, model_state, aux, count

        micro = jax.tree.map(
            lambda x: x.reshape((accumulate_steps, size // accumulate_steps) + x.shape[1:]), batch
        )

        def body(carry, inputs):
            grad_sum, model_state = carry
            index, micro_batch = inputs
            key = None if rng is None else jax.random.fold_in(rng, index)
            grads, loss, model_state, aux = local_loss_and_grads(
                state, params, model_state, micro_batch, key
            )
            count = _count(micro_batch)
            grad_sum = jax.tree.map(jnp.add, grad_sum, _weigh(grads, count))
            return (grad_sum, model_state), (loss, aux, count)

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, model_state), (losses, auxes, counts) = lax.scan(
            body, (zeros, model_state), (jnp.arange(accumulate_steps), micro)
        )
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
        if counts is None:
            grads = jax.tree.map(lambda g: g / accumulate_steps, grads)
            return grads, jnp.mean(losses), model_state, aux, None
        count = jnp.sum(counts)
        loss = jnp.sum(losses * counts) / jnp.maximum(count, 1.0)
        return grads, loss, model_state, aux, count

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"train_step: state must be a jdp.TrainState, got {type(state).__name__}. "
                "Build one with jdp.TrainState.create(params=..., tx=...)."
            )
        size = batch_size(batch)
        if size % accumulate_steps:
            raise ValueError(
                f"accumulate_steps={accumulate_steps} does not divide the per-replica "
                f"batch of {size} examples. Use a global batch divisible by "
                f"accumulate_steps x number of devices."
            )
        rng = None
        if has_rng:
            if state.rng is None:
                raise ValueError(
                    "make_train_step(has_rng=True) needs a key in the state: "
                    "TrainState.create(..., rng=jax.random.key(0))."
                )
            rng = replica_rng(state.rng, state.step, axis_name)

        grads, loss, model_state, aux, count = accumulate(state, batch, size, rng)
        grads = state.loss_scale.unscale(reduce_gradients(grads, axis_name, grad_reduce, count))
        if has_model_state:
            model_state = average_model_state(model_state, axis_name)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        metrics = {"loss": loss, **aux}
        finite = None  # NoOpLossScale never skips
        skipped_steps = state.skipped_steps
        if not isinstance(state.loss_scale, NoOpLossScale):
            finite = all_finite(grads)
            params, opt_state, model_state = _select(
                finite,
                (params, opt_state, model_state),
                (state.params, state.opt_state, state.model_state),
            )
            skipped_steps = state.skipped_steps + (~finite).astype(jnp.int32)
            metrics.update(
                grads_finite=finite,
                loss_scale=state.loss_scale.loss_scale,
                skipped_steps=skipped_steps,
            )
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=state.loss_scale.adjust(finite),
            skipped_steps=skipped_steps,
        )
        return new_state, metrics

    train_step.axis_name = axis_name
    return train_step


def _select(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: lax.select(pred, a, b), on_true, on_false)


def _count(batch: PyTree) -> jax.Array | None:
    """The number of real examples when the batch carries a mask, else None."""
    if not (isinstance(batch, Mapping) and MASK_KEY in batch):
        return None
    mask = batch[MASK_KEY]
    if mask.ndim != 1:
        raise ValueError(
            f"batch[{MASK_KEY!r}] must be a 1-D per-example mask, got shape {mask.shape}."
        )
    return jnp.sum(mask.astype(jnp.float32))


def _weigh(grads: PyTree, count: jax.Array | None) -> PyTree:
    # A replica (or micro-batch) of padding only contributes exact zeros,
    # even when its loss is NaN.
    if count is None:
        return grads
    return jax.tree.map(lambda g: jnp.where(count > 0, g * count.astype(g.dtype), 0), grads)


def _unpack(out: Any, has_aux: bool, has_model_state: bool):
    expected = {
        (False, False): "loss",
        (True, False): "(loss, aux)",
        (False, True): "(loss, new_model_state)",
        (True, True): "(loss, (new_model_state, aux))",
    }[(has_aux, has_model_state)]
    loss, model_state, aux = out, None, {}
    try:
        if has_aux or has_model_state:
            loss, rest = out
            if has_aux and has_model_state:
                model_state, aux = rest
            elif has_aux:
                aux = rest
            else:
                model_state = rest
    except (TypeError, ValueError):
        raise TypeError(
            f"loss_fn must return {expected} (has_aux={has_aux}, "
            f"has_model_state={has_model_state}); got {type(out).__name__}."
        ) from None
    if not hasattr(loss, "shape") or jnp.ndim(loss) != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}. "
            "Reduce it over the batch, e.g. jnp.mean(per_example_loss) or "
            "jdp.masked_mean(per_example_loss, batch['mask'])."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss_fn must return a floating loss, got dtype {loss.dtype}.")
    if not isinstance(aux, Mapping):
        raise TypeError(
            f"With has_aux=True, aux must be a dict of arrays (it joins the "
            f"metrics), got {type(aux).__name__}."
        )
    clash = sorted(set(aux) & set(RESERVED_METRICS))
    if clash:
        raise ValueError(f"aux keys {clash} are reserved for jdp's own metrics; rename them.")
    return loss, model_state, aux

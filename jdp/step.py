"""The per-replica training step and its composable pieces.

Nothing here knows which backend runs it: the step uses only collectives
over ``axis_name``, so ``jdp.pmap`` and ``jdp.shard_map`` wrap it unchanged.
"""

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import exact, optimizer_sharding
from jdp.loss_scale import NoOpLossScale, all_finite
from jdp.precision import Policy, as_policy
from jdp.sharding import AXIS_NAME, batch_size, leaves_with_paths
from jdp.state import TrainState
from jdp.types import PyTree
from jdp.weighting import WeightedLoss, safe_divide, weighted_average, zero_where_weightless

RESERVED_METRICS = (
    "loss",
    "weight",
    "grads_finite",
    "loss_scale",
    "skipped_steps",
    "grad_norm",
    "learning_rate",
    "virtual_replica_loss",
)
GRAD_REDUCTIONS = ("mean", "sum")

Step = Callable[[TrainState, PyTree], tuple[TrainState, dict[str, jax.Array]]]


class Local(NamedTuple):
    """One replica's (or micro-batch's) contribution, before any collective.

    ``grads`` is the gradient of the scaled loss: of the summed ``total`` for a
    :class:`jdp.WeightedLoss` (``weight`` its weight), of the mean loss for a
    plain scalar (``weight`` None). ``aux`` holds the aux metrics.
    """

    grads: PyTree
    total: jax.Array
    weight: jax.Array | None
    model_state: PyTree
    aux: dict[str, jax.Array]


def replica_rng(key: jax.Array, step: jax.Array, axis_name: str = AXIS_NAME) -> jax.Array:
    """A key distinct per replica and step, deterministic in (key, step, replica).

    Use inside a step, under a backend that binds ``axis_name``.
    """
    return jax.random.fold_in(jax.random.fold_in(key, step), lax.axis_index(axis_name))


def reduce_gradients(
    grads: PyTree,
    axis_name: str,
    grad_reduce: str,
    weight: jax.Array | None = None,
) -> PyTree:
    """All-reduces per-replica gradients.

    Args:
      grads: this replica's gradient; of its summed loss when ``weight`` is
        given, of its mean loss otherwise.
      axis_name: the data axis.
      grad_reduce: ``"mean"``: with a weight, the gradients and weights are
        summed over replicas and divided once (the gradient of
        ``sum(totals) / sum(weights)``); without, the mean over replicas.
        ``"sum"``: the sum of per-replica mean gradients (Chainer's
        ``addgrads``, Caffe2's all-reduce).
      weight: this replica's weight (:class:`jdp.WeightedLoss`), or None for
        equal replica weights.
    """
    if weight is None:
        reduce = lax.pmean if grad_reduce == "mean" else lax.psum
        return reduce(grads, axis_name)
    if grad_reduce == "mean":
        grads, total = lax.psum((grads, weight), axis_name)
        return jax.tree.map(lambda g: safe_divide(g, total.astype(g.dtype)), grads)
    return lax.psum(
        jax.tree.map(lambda g: safe_divide(g, weight.astype(g.dtype)), grads), axis_name
    )


def apply_gradients(
    state: TrainState, grads: PyTree, *, model_state: PyTree = None, axis_name: str | None = None
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
    if model_state is None:
        model_state = state.model_state
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
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


def _apply_sharded(
    state: TrainState, grads: PyTree, *, model_state: PyTree, axis_name: str
) -> tuple[TrainState, dict[str, jax.Array]]:
    """:func:`apply_gradients` on this replica's slices; the new params all-gathered."""
    n = lax.axis_size(axis_name)
    sharded = state.opt_state
    if not isinstance(sharded, optimizer_sharding.ShardedOptState):
        raise TypeError(
            "make_train_step(shard_optimizer=True) needs the optimizer state split over the "
            f"devices, got a {type(sharded).__name__}. Place the state with the wrapper: "
            "state = step.replicate(jdp.TrainState.create(...))."
        )
    if sharded.num_shards != n:
        raise ValueError(
            f"The optimizer state is split {sharded.num_shards} ways but the step runs on {n} "
            "devices. Re-place it: state = step.replicate(other_step.unreplicate(state)), or "
            "restore a checkpoint (checkpoints hold the whole state)."
        )
    slices = optimizer_sharding.param_slices(state.params, lax.axis_index(axis_name), n)
    view = state.replace(params=slices, opt_state=sharded.shards)
    with optimizer_sharding.sharded_update(axis_name, state.params, n):
        optimizer_sharding.check_elementwise(state.tx.update, grads, sharded.shards, slices)
        new, info = apply_gradients(view, grads, model_state=model_state, axis_name=axis_name)
    return new.replace(
        params=optimizer_sharding.gather_params(new.params, state.params, axis_name),
        opt_state=optimizer_sharding.ShardedOptState(new.opt_state, sharded.logical_shapes, n),
    ), info


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    axis_name: str = AXIS_NAME,
    grad_reduce: str = "mean",
    has_aux: bool = False,
    has_model_state: bool = False,
    has_rng: bool = False,
    accumulate_steps: int = 1,
    precision: Policy | Any = None,
    log_grad_norm: bool = False,
    log_learning_rate: bool | Callable[[jax.Array], jax.Array] = False,
    virtual_replicas: int | None = None,
    shard_optimizer: bool = False,
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
    and ``rng=<this replica's key>`` when ``has_rng``. ``aux`` is a dict of
    scalar means that joins the metrics.

    ``loss`` is either a scalar, the mean over this replica's examples
    (replicas and micro-batches weighted equally), or a
    :class:`jdp.WeightedLoss` ``(total, weight)``: the summed loss and what it
    is summed over (real examples, tokens). With a ``WeightedLoss`` the update
    is the gradient of ``sum(totals) / sum(weights)`` over the global batch,
    exactly; padding, masks and variable-length sequences need nothing else
    (:func:`jdp.weighted_mean` builds one from per-example or per-token values
    and a mask), and aux metrics and model state are weighted alike.

    Args:
      loss_fn: the loss, as above.
      axis_name: the data axis the backend binds.
      grad_reduce: ``"mean"`` (equals single-device training on the global
        batch) or ``"sum"`` (sum of per-replica mean gradients, the seeds' rule).
      has_aux: the loss also returns a dict of metrics.
      has_model_state: the loss takes and returns mutable model state.
      has_rng: the loss takes a per-replica, per-step PRNG key.
      accumulate_steps: split each replica's batch into this many
        micro-batches, accumulate their gradients locally and all-reduce once.
      precision: a :class:`jdp.Policy` (or a bare compute dtype such as
        ``jnp.bfloat16``, which casts params only): floating params, and the
        batch leaves the policy names, are cast for the forward and backward
        pass; master params, optimizer state, the all-reduce and the update
        stay in their own dtype.
      log_grad_norm: add ``grad_norm``, the global norm of the reduced,
        unscaled gradients, to the metrics.
      log_learning_rate: add ``learning_rate``, the rate this step used:
        ``True`` reads it from ``optax.inject_hyperparams`` state; an optax
        schedule (the one given to the optimizer) is evaluated at the
        optimizer's own count, which skipped steps do not advance.
      virtual_replicas: exact mode (see ``docs/exact.md``): split the global
        batch into this many micro-batches (a power of two that the device
        count divides) and reduce them in one fixed order, so the result is
        bitwise the same on any number of devices and processes. Metrics are
        then the global values, identical on every device, plus
        ``virtual_replica_loss``: each virtual replica's own loss, shape (G,).
      shard_optimizer: weight-update sharding (ZeRO-1, ``docs/memory.md``):
        each replica holds and updates 1/n of the optimizer state; gradients
        are reduce-scattered and the new parameters all-gathered. The same
        update for elementwise optimizers; a transform that reduces over a
        slice is refused when the step is first traced. Place the state with
        the wrapper's ``step.replicate``.

    Returns:
      The step. Its metrics hold ``loss`` (this replica's weighted mean,
      float32), ``weight`` (with a ``WeightedLoss``) and the aux entries; with
      a static or dynamic loss scale also ``grads_finite``, ``loss_scale`` (the
      scale this step used) and ``skipped_steps``.

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
    _check_options(loss_fn, grad_reduce, accumulate_steps)
    _check_modes(virtual_replicas, accumulate_steps, grad_reduce, shard_optimizer)
    policy = as_policy(precision)
    forward = _make_forward(loss_fn, policy, has_aux, has_model_state, has_rng)

    train_step = _build_step(
        forward,
        axis_name=axis_name,
        grad_reduce=grad_reduce,
        has_model_state=has_model_state,
        has_rng=has_rng,
        accumulate_steps=accumulate_steps,
        log_grad_norm=log_grad_norm,
        log_learning_rate=log_learning_rate,
        virtual_replicas=virtual_replicas,
        shard_optimizer=shard_optimizer,
    )
    train_step.axis_name = axis_name
    train_step.shard_optimizer = shard_optimizer
    return train_step


def _build_step(
    forward,
    *,
    axis_name,
    grad_reduce,
    has_model_state,
    has_rng,
    accumulate_steps,
    log_grad_norm,
    log_learning_rate,
    virtual_replicas,
    shard_optimizer,
) -> Step:
    """The per-replica step around ``forward``: contribution, reduction, update, metrics."""

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        _check_state(state, has_model_state, has_rng, shard_optimizer)
        size = batch_size(batch)
        if size % accumulate_steps:
            raise ValueError(
                f"accumulate_steps={accumulate_steps} does not divide the per-replica "
                f"batch of {size} examples. Use a global batch divisible by "
                f"accumulate_steps x number of devices."
            )
        if virtual_replicas is None:
            rng = replica_rng(state.rng, state.step, axis_name) if has_rng else None
            reduce = (
                optimizer_sharding.reduce_scatter_gradients if shard_optimizer else reduce_gradients
            )
            grads, loss, weight, model_state, aux = _replica_contribution(
                forward, state, batch, rng, accumulate_steps, axis_name, grad_reduce, reduce
            )
        else:  # exact mode: global values, identical on every device
            rng = jax.random.fold_in(state.rng, state.step) if has_rng else None
            reduced = exact.run(forward, state, batch, rng, virtual_replicas, axis_name)
            grads, loss, weight, model_state, aux = reduced[:5]
            aux = {**aux, "virtual_replica_loss": reduced.virtual_replica_loss}
        grads = state.loss_scale.unscale(grads)
        before, params = state.opt_state, state.params
        apply = partial(_apply_sharded, axis_name=axis_name) if shard_optimizer else apply_gradients
        state, info = apply(state, grads, model_state=model_state if has_model_state else None)
        metrics = {"loss": loss, **aux, **info}
        if weight is not None:
            metrics["weight"] = weight
        if log_grad_norm and shard_optimizer:
            with optimizer_sharding.sharded_update(axis_name, params, lax.axis_size(axis_name)):
                metrics["grad_norm"] = optimizer_sharding.global_norm(grads)
        elif log_grad_norm:
            metrics["grad_norm"] = optax.tree.norm(grads)
        if log_learning_rate is not False:
            metrics["learning_rate"] = _learning_rate(log_learning_rate, before, state.opt_state)
        return state, metrics

    return train_step


def _replica_contribution(
    forward, state, batch, rng, accumulate_steps, axis_name, grad_reduce, reduce
):
    """``(reduced grads, this replica's loss, weight, averaged model state, aux)``."""
    local = _accumulate(forward, state, batch, rng, accumulate_steps)
    grads = reduce(local.grads, axis_name, grad_reduce, local.weight)
    model_state = weighted_average(local.model_state, local.weight, axis_name)
    weighted = local.weight is not None
    loss = safe_divide(local.total, local.weight) if weighted else local.total
    return grads, loss, local.weight, model_state, local.aux


def _check_options(loss_fn, grad_reduce, accumulate_steps) -> None:
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


def _check_modes(virtual_replicas, accumulate_steps, grad_reduce, shard_optimizer) -> None:
    """Exact mode and weight-update sharding: each valid, and not both."""
    if not isinstance(shard_optimizer, bool):
        raise TypeError(
            f"make_train_step: shard_optimizer must be a bool, got {shard_optimizer!r}."
        )
    if virtual_replicas is None:
        return
    exact.check_virtual_replicas(virtual_replicas, accumulate_steps, grad_reduce)
    if shard_optimizer:
        raise ValueError(
            "make_train_step: shard_optimizer=True does not combine with exact mode "
            "(virtual_replicas) yet; choose one of them."
        )


def _check_state(state, has_model_state: bool, has_rng: bool, shard_optimizer: bool) -> None:
    """Trace-time checks of the state against the step's options."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"train_step: state must be a jdp.TrainState, got {type(state).__name__}. "
            "Build one with jdp.TrainState.create(params=..., tx=...)."
        )
    if has_rng and state.rng is None:
        raise ValueError(
            "make_train_step(has_rng=True) needs a key in the state: "
            "TrainState.create(..., rng=jax.random.key(0))."
        )
    if isinstance(state.opt_state, optimizer_sharding.ShardedOptState) and not shard_optimizer:
        raise TypeError(
            "The state's optimizer state is split over the devices (placed for a "
            "make_train_step(shard_optimizer=True) step), but this step holds it whole. "
            "Re-place it: state = step.replicate(sharded_step.unreplicate(state)), or build "
            "this step with shard_optimizer=True."
        )
    if has_model_state and state.model_state is None:
        raise ValueError(
            "make_train_step(has_model_state=True) needs model state in the state: "
            "TrainState.create(..., model_state=variables['batch_stats'])."
        )
    for name, leaf in leaves_with_paths(state.params, "state.params"):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"Parameter {name} has dtype {leaf.dtype}; every leaf of params must be "
                "floating to be differentiated. Move integer values (counters, RNG "
                "state) into model_state or out of the state."
            )


def _make_forward(loss_fn, policy: Policy, has_aux: bool, has_model_state: bool, has_rng: bool):
    """``(state, params, model_state, batch, rng) -> Local`` for one (micro-)batch."""

    def forward(state, params, model_state, batch, rng) -> Local:
        def scaled_loss(p):
            extra = {}
            if has_model_state:
                extra["model_state"] = model_state
            if has_rng:
                extra["rng"] = rng
            out = loss_fn(policy.cast_params(p), policy.cast_batch_leaves(batch), **extra)
            loss, new_model_state, aux = _unpack(out, has_aux, has_model_state)
            if isinstance(loss, WeightedLoss):
                total, weight = loss.total.astype(jnp.float32), loss.weight.astype(jnp.float32)
            else:
                total, weight = loss.astype(jnp.float32), None
            return state.loss_scale.scale(total), (total, weight, new_model_state, aux)

        (_, (total, weight, new_model_state, aux)), grads = jax.value_and_grad(
            scaled_loss, has_aux=True
        )(params)
        aux = {k: jnp.asarray(v).astype(jnp.float32) for k, v in aux.items()}
        return Local(zero_where_weightless(grads, weight), total, weight, new_model_state, aux)

    return forward


def _accumulate(forward, state: TrainState, batch: PyTree, rng, steps: int) -> Local:
    """This replica's contribution, summed over ``steps`` micro-batches.

    A weighted loss sums totals, gradients and weighted aux over micro-batches
    (a micro-batch of weight 0 leaves the model state alone); a plain loss
    averages them.
    """
    params, model_state = state.params, state.model_state
    if steps == 1:
        return forward(state, params, model_state, batch, rng)
    micro = jax.tree.map(lambda x: x.reshape((steps, x.shape[0] // steps) + x.shape[1:]), batch)

    def body(carry, inputs):
        grads, total, weight, model_state, aux = carry
        index, micro_batch = inputs
        key = None if rng is None else jax.random.fold_in(rng, index)
        out = forward(state, params, model_state, micro_batch, key)
        w = jnp.float32(1.0) if out.weight is None else out.weight
        if out.weight is not None:
            model_state = jax.tree.map(
                lambda new, old: jnp.where(w > 0, new, old), out.model_state, model_state
            )
        else:
            model_state = out.model_state
        aux = {k: aux[k] + zero_where_weightless(v * w, out.weight) for k, v in out.aux.items()}
        carry = (
            jax.tree.map(jnp.add, grads, out.grads),
            total + zero_where_weightless(out.total, out.weight),
            weight + w,
            model_state,
            aux,
        )
        return carry, None

    first_micro = jax.tree.map(lambda x: x[0], micro)
    first = jax.eval_shape(lambda b: forward(state, params, model_state, b, rng), first_micro)
    init = (
        jax.tree.map(jnp.zeros_like, params),
        jnp.float32(0.0),
        jnp.float32(0.0),
        model_state,
        {k: jnp.zeros((), jnp.float32) for k in first.aux},
    )
    (grads, total, weight, model_state, aux), _ = lax.scan(body, init, (jnp.arange(steps), micro))
    aux = {k: safe_divide(v, weight) for k, v in aux.items()}
    if first.weight is None:
        return Local(
            jax.tree.map(lambda g: g / steps, grads), total / steps, None, model_state, aux
        )
    return Local(grads, total, weight, model_state, aux)


def _learning_rate(source, old_opt_state: PyTree, new_opt_state: PyTree) -> jax.Array:
    """The learning rate of this step, from inject_hyperparams or a schedule."""

    def find(tree, wanted):
        nodes = jax.tree.leaves(tree, is_leaf=wanted)
        return next((node for node in nodes if wanted(node)), None)

    if source is True:
        injected = find(
            new_opt_state,
            lambda x: (
                isinstance(getattr(x, "hyperparams", None), dict)
                and "learning_rate" in x.hyperparams
            ),
        )
        if injected is None:
            raise ValueError(
                "log_learning_rate=True reads the rate from optax.inject_hyperparams state, "
                "and the optimizer has none: wrap it, optax.inject_hyperparams(optax.adam)"
                "(learning_rate=...), or pass the schedule: log_learning_rate=schedule."
            )
        return jnp.asarray(injected.hyperparams["learning_rate"], jnp.float32)
    if not callable(source):
        raise TypeError(f"log_learning_rate must be True or an optax schedule, got {source!r}.")
    counter = find(old_opt_state, lambda x: isinstance(x, optax.ScaleByScheduleState))
    if counter is None:
        raise ValueError(
            "log_learning_rate=schedule needs an optimizer built with that schedule "
            "(its state holds the schedule's count), e.g. optax.adam(schedule)."
        )
    return jnp.asarray(source(counter.count), jnp.float32)


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
    _check_loss(loss)
    if not isinstance(aux, Mapping):
        raise TypeError(
            f"With has_aux=True, aux must be a dict of arrays (it joins the "
            f"metrics), got {type(aux).__name__}."
        )
    clash = sorted(set(aux) & set(RESERVED_METRICS))
    if clash:
        raise ValueError(f"aux keys {clash} are reserved for jdp's own metrics; rename them.")
    return loss, model_state, aux


def _check_loss(loss: Any) -> None:
    if isinstance(loss, WeightedLoss):
        for field in ("total", "weight"):
            value = getattr(loss, field)
            if not isinstance(value, jax.Array) or value.ndim != 0:
                raise ValueError(
                    f"WeightedLoss.{field} must be a scalar array, got shape "
                    f"{jnp.shape(value)}; sum over the batch, e.g. jdp.weighted_mean(values, mask)."
                )
        if not jnp.issubdtype(loss.total.dtype, jnp.floating):
            raise TypeError(f"WeightedLoss.total must be floating, got dtype {loss.total.dtype}.")
        return
    if isinstance(loss, (int, float)):
        raise TypeError(
            f"loss_fn returned a Python {type(loss).__name__} ({loss!r}); the loss must be "
            "a JAX scalar computed from params (a constant has no gradient)."
        )
    if not isinstance(loss, jax.Array) or loss.ndim != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}. "
            "Reduce it over the batch, e.g. jnp.mean(per_example_loss), or return "
            "jdp.weighted_mean(per_example_loss, mask)."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss_fn must return a floating loss, got dtype {loss.dtype}.")

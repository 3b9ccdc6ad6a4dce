"""make_train_step: the per-replica training step, one strategy at its seam.

Nothing here knows which backend runs the step or how its strategy crosses
replicas: the step calls ``strategy.gradients``, unscales, calls
``strategy.update`` and collects the metrics.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.typing import DTypeLike

from jdp import _phases
from jdp import metrics as _metrics
from jdp._args import check_bool, check_name
from jdp._audit import Audit
from jdp._batching import AXIS_NAME, leaves_with_paths
from jdp._forward import Forward, check_call, make_forward
from jdp._loss_scale import NoOpLossScale
from jdp._precision import Policy, as_policy
from jdp._state import TrainState
from jdp._steps import Metrics, TrainStep
from jdp._tree import PyTree
from jdp.metrics import Metric, StepView
from jdp.strategies import Strategy, data_parallel, exact, zero1

# Keyword arguments replaced by strategies: (deprecated in, removed in, the replacement).
DEPRECATED = {
    "grad_reduce": ("0.1.0", "0.2.0", "strategy=jdp.strategies.data_parallel(reduce=...)"),
    "accumulate_steps": (
        "0.1.0",
        "0.2.0",
        "strategy=jdp.strategies.data_parallel(accumulate_steps=...)",
    ),
    "virtual_replicas": ("0.1.0", "0.2.0", "strategy=jdp.strategies.exact(virtual_replicas)"),
    "shard_optimizer": ("0.1.0", "0.2.0", "strategy=jdp.strategies.zero1()"),
}

# What jdp.fit's history rows hold beside a step's metrics.
ROW_KEYS = ("step", "examples_per_s", "weight_per_s", "time")

# The rules of the metrics every step returns: the loss, its weight and apply_gradients' own.
_OWN_RULES = {
    "loss": _metrics.weighted_mean,
    "weight": _metrics.total,
    "grads_finite": _metrics.same,
    "loss_scale": _metrics.same,
    "skipped_steps": _metrics.exact_int,
}
# Names a metric of the user's may not take.
_RESERVED = frozenset(_OWN_RULES) | frozenset(ROW_KEYS)


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    strategy: Strategy | None = None,
    axis_name: str = AXIS_NAME,
    has_aux: bool = False,
    has_model_state: bool = False,
    has_rng: bool = False,
    precision: Policy | DTypeLike | None = None,
    metrics: Sequence[Metric] = (),
    log_grad_norm: bool = False,
    log_learning_rate: bool | Callable[[jax.Array], jax.Array] = False,
    audit: Audit | None = None,
    **deprecated: Any,
) -> TrainStep:
    """Builds a pure per-replica step ``(state, batch) -> (state, metrics)``.

    The step computes this replica's loss under ``state.loss_scale``, takes
    gradients, reduces them over ``axis_name`` as its ``strategy`` says,
    unscales them, decides once whether they are finite, and applies
    ``state.tx`` identically on every replica. Wrap it with :func:`jdp.pmap`
    or :func:`jdp.shard_map`.

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
    means (numeric arrays, scalars or vectors) that joins the metrics.

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
      strategy: how gradients cross replicas and where the state lives
        (``jdp.strategies``): :func:`~jdp.strategies.data_parallel` (the
        default: one all-reduce, equal to single-device training on the
        global batch; options ``reduce`` and ``accumulate_steps``),
        :func:`~jdp.strategies.zero1` (weight-update sharding, 1/n of the
        optimizer state per device, ``docs/memory.md``) or
        :func:`~jdp.strategies.exact` (bitwise the same result on any device
        count, ``docs/exact.md``).
      axis_name: the data axis the backend binds.
      has_aux: the loss also returns a dict of metrics.
      has_model_state: the loss takes and returns mutable model state.
      has_rng: the loss takes a per-replica, per-step PRNG key.
      precision: a :class:`jdp.Policy` (or a bare compute dtype such as
        ``jnp.bfloat16``, which casts params only): floating params, and the
        batch leaves the policy names, are cast for the forward and backward
        pass; master params, optimizer state, the all-reduce and the update
        stay in their own dtype.
      metrics: more metrics, :class:`jdp.metrics.Metric` values (e.g.
        ``jdp.metrics.grad_norm()``); each carries the rule by which
        ``jdp.fit`` combines replicas.
      log_grad_norm: ``metrics=[jdp.metrics.grad_norm()]``: ``grad_norm``,
        the global norm of the reduced, unscaled gradients.
      log_learning_rate: ``metrics=[jdp.metrics.learning_rate(source)]``:
        ``learning_rate``, the rate this step used. ``True`` reads it from
        ``optax.inject_hyperparams`` state; an optax schedule (the one given
        to the optimizer) is evaluated at the optimizer's own count, which
        skipped steps do not advance.
      audit: a :class:`jdp.Audit`: every ``audit.every`` steps, check on
        device that every replica holds bitwise the same new state (one
        small collective), and raise, warn or end the job if not, naming
        the step, the replica, its device and the first leaf that differs
        (``docs/audit.md``). Off by default.
      **deprecated: ``grad_reduce``, ``accumulate_steps``,
        ``virtual_replicas`` and ``shard_optimizer``, deprecated in 0.1.0 and
        removed in 0.2.0 (:data:`DEPRECATED` names each one's strategy).

    Returns:
      A :class:`jdp.TrainStep`. Its metrics hold ``loss`` (this replica's weighted mean,
      float32), ``weight`` (with a ``WeightedLoss``) and the aux entries; with
      a static or dynamic loss scale also ``grads_finite``, ``loss_scale`` (the
      scale this step used) and ``skipped_steps``; with exact mode also
      ``virtual_replica_loss``; with ``audit``, ``audit``.

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
        raise TypeError(f"jdp.make_train_step: loss_fn must be callable, got {loss_fn!r}.")
    flags = {"has_aux": has_aux, "has_model_state": has_model_state, "has_rng": has_rng}
    for flag, value in flags.items():
        check_bool(value, flag, where="jdp.make_train_step")
    check_name(axis_name, "axis_name", where="jdp.make_train_step")
    unknown = sorted(set(deprecated) - set(DEPRECATED))
    if unknown:
        raise TypeError(f"jdp.make_train_step() got an unexpected keyword argument {unknown[0]!r}.")
    strategy = _strategy(strategy, {k: v for k, v in deprecated.items() if v is not None})
    if audit is not None and not isinstance(audit, Audit):
        raise TypeError(
            f"jdp.make_train_step: audit must be a jdp.Audit, e.g. audit=jdp.Audit(every=100), "
            f"or None, got {audit!r:.80}."
        )
    extra_metrics = () if audit is None else (audit.metric(),)
    requested = _requested_metrics(metrics, log_grad_norm, log_learning_rate, extra_metrics)
    policy = as_policy(precision)
    extra = ("model_state",) * has_model_state + ("rng",) * has_rng
    check_call(loss_fn, extra, "jdp.make_train_step", "loss_fn")
    forward = make_forward(loss_fn, policy, has_aux, has_model_state, has_rng)
    fn = _build_step(forward, strategy, axis_name, has_model_state, has_rng, requested, policy)
    rules = {**_OWN_RULES, **dict(strategy.metric_rules), **{m.name: m.rule for m in requested}}
    return TrainStep(fn, axis_name, strategy, tuple(rules.items()), audit)


def _check_metric(m: Metric) -> None:
    if not isinstance(m.name, str) or not m.name:
        raise TypeError(f"jdp.metrics.Metric: name must be a non-empty string, got {m.name!r}.")
    kinds = {
        "compute": "(view: jdp.metrics.StepView) -> array, run inside the step",
        "rule": "(values, weights) -> value, how replicas' values combine (e.g. jdp.metrics.mean)",
    }
    for field, what in kinds.items():
        if not callable(getattr(m, field)):
            raise TypeError(
                f"jdp.metrics.Metric {m.name!r}: {field} must be a function {what}, got "
                f"{getattr(m, field)!r:.60}."
            )


def _requested_metrics(
    metrics: Sequence[Metric],
    log_grad_norm: bool,
    log_learning_rate: bool | Callable[[jax.Array], jax.Array],
    own: tuple[Metric, ...],
) -> tuple[Metric, ...]:
    """``metrics``, with the two flags and the step's ``own`` as Metric values, checked once."""
    if isinstance(metrics, Metric) or not isinstance(metrics, Sequence):
        raise TypeError(
            "jdp.make_train_step: metrics must be a list of jdp.metrics.Metric values, e.g. "
            f"metrics=[jdp.metrics.grad_norm()], got {metrics!r:.80}."
        )
    out = list(metrics)
    for m in out:
        if not isinstance(m, Metric):
            raise TypeError(
                f"jdp.make_train_step: metrics holds {m!r:.60}, not a jdp.metrics.Metric; build one "
                "with jdp.metrics.Metric(name, compute, rule)."
            )
        _check_metric(m)
    if not isinstance(log_grad_norm, bool):
        raise TypeError(
            f"jdp.make_train_step: log_grad_norm must be a bool, got {log_grad_norm!r}."
        )
    if log_grad_norm:
        out.append(_metrics.grad_norm())
    if log_learning_rate is not False:
        out.append(_metrics.learning_rate(log_learning_rate))
    out.extend(own)
    names = [m.name for m in out]
    repeated = sorted({n for n in names if names.count(n) > 1} | (set(names) & _RESERVED))
    if repeated:
        raise ValueError(
            f"jdp.make_train_step: metric names {repeated} are given twice or are the step's own "
            f"({', '.join(sorted(_RESERVED))}); rename them."
        )
    return tuple(out)


def _strategy(strategy: Strategy | None, legacy: dict[str, Any]) -> Strategy:
    """The step's strategy; the deprecated keyword arguments mapped onto one."""
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(
            "jdp.make_train_step: strategy must be a jdp.strategies.Strategy, e.g. "
            f"jdp.strategies.zero1(), got {strategy!r:.80}."
        )
    if not legacy:
        return data_parallel() if strategy is None else strategy
    names = ", ".join(f"{k}={v!r}" for k, v in legacy.items())
    if strategy is not None:
        raise ValueError(
            f"jdp.make_train_step: {names} and strategy= both choose how gradients cross replicas; "
            "pass the options to the strategy's constructor instead, e.g. "
            "strategy=jdp.strategies.data_parallel(accumulate_steps=2)."
        )
    deprecated = dict(legacy)
    shard = legacy.pop("shard_optimizer", False)
    if not isinstance(shard, bool):
        raise TypeError(f"jdp.make_train_step: shard_optimizer must be a bool, got {shard!r}.")
    g = legacy.pop("virtual_replicas", None)
    options = {"reduce" if k == "grad_reduce" else k: v for k, v in legacy.items()}
    if g is not None and (shard or options):
        raise ValueError(
            f"jdp.make_train_step: virtual_replicas (exact mode) does not combine with {names}: "
            "exact mode has its own micro-batches and reduction. Use "
            "strategy=jdp.strategies.exact(virtual_replicas) alone, with "
            "shard_optimizer_state=True to split the optimizer state."
        )
    built = exact(g) if g is not None else (zero1 if shard else data_parallel)(**options)
    replacement = {"exact": f"exact({g})", "zero1": "zero1(...)"}.get(
        built.name, "data_parallel(...)"
    )
    since, removal, _ = DEPRECATED[next(iter(deprecated))]
    warnings.warn(
        f"make_train_step({names}) is deprecated in {since} and removed in {removal}; pass "
        f"strategy=jdp.strategies.{replacement} instead (same result).",
        DeprecationWarning,
        stacklevel=3,
    )
    return built


def _build_step(
    forward: Forward,
    strategy: Strategy,
    axis_name: str,
    has_model_state: bool,
    has_rng: bool,
    requested: tuple[Metric, ...],
    policy: Policy | None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, Metrics]]:
    """The per-replica step around ``forward``: reduction, update, metrics."""

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        _check_state(state, has_model_state, has_rng)
        _warn_float16_unscaled(policy, state)
        batch = _phases.mark(_phases.START, batch, axis_name, split=[])
        out = strategy.gradients(forward, state, batch, axis_name)
        grads = state.loss_scale.unscale(out.grads)
        before = state
        model_state = out.model_state if has_model_state else None
        state, info = strategy.update(state, grads, model_state, axis_name)
        state = _phases.mark(_phases.UPDATE, state, axis_name)
        own = {"loss": out.loss, **info, **({} if out.weight is None else {"weight": out.weight})}
        clash = sorted(set(out.aux) & (set(own) | _RESERVED | {m.name for m in requested}))
        if clash:
            raise ValueError(
                f"jdp.make_train_step: aux keys {clash} are reserved for jdp's own metrics (or the step's metrics=, "
                f"or jdp.fit's history rows: {', '.join(ROW_KEYS)}); rename them."
            )
        view = StepView(
            before,
            state,
            grads,
            lambda g: strategy.global_norm(g, before.params, axis_name),
            axis_name,
        )
        return state, {**out.aux, **own, **{m.name: m.compute(view) for m in requested}}

    return train_step


def _warn_float16_unscaled(policy: Policy | None, state: TrainState) -> None:
    """float16 gradients without a loss scale underflow (to zero: no update) on most models."""
    dtype = None if policy is None else policy.compute_dtype
    if dtype is None or jax.numpy.dtype(dtype) != jax.numpy.float16:
        return
    if isinstance(state.loss_scale, NoOpLossScale):
        warnings.warn(
            "make_train_step(precision=float16) with no loss scale: float16 gradients below "
            "6e-8 round to zero, so small gradients (most of a deep model's) make no update. "
            "Train with TrainState.create(..., loss_scale=jdp.DynamicLossScale(2.0**15)), or "
            "use bfloat16 (float32's range, no scale needed).",
            UserWarning,
            stacklevel=2,
        )


def _check_state(state: object, has_model_state: bool, has_rng: bool) -> None:
    """Trace-time checks of the state against the step's options."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"jdp.make_train_step: the step's state must be a jdp.TrainState, got {type(state).__name__}. "
            "Build one with jdp.TrainState.create(params=..., tx=...)."
        )
    if has_rng and state.rng is None:
        raise ValueError(
            "jdp.make_train_step(has_rng=True) needs a key in the state: "
            "TrainState.create(..., rng=jax.random.key(0))."
        )
    if has_model_state and state.model_state is None:
        raise ValueError(
            "jdp.make_train_step(has_model_state=True) needs model state in the state: "
            "TrainState.create(..., model_state=variables['batch_stats'])."
        )
    for name, leaf in leaves_with_paths(state.params, "jdp.make_train_step: state.params"):
        if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
            raise TypeError(
                f"jdp.make_train_step: parameter {name} has dtype {leaf.dtype}; every leaf of params must be "
                "floating to be differentiated. Move integer values (counters, RNG "
                "state) into model_state or out of the state."
            )

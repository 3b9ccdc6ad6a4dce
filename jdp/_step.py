"""make_train_step: the per-replica training step, one strategy at its seam.

Nothing here knows which backend runs the step or how its strategy crosses
replicas: the step calls ``strategy.gradients``, unscales, calls
``strategy.update`` and collects the metrics.
"""

import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
from jax.typing import DTypeLike

from jdp._batching import AXIS_NAME, leaves_with_paths
from jdp._forward import Forward, make_forward
from jdp._metrics import learning_rate
from jdp._precision import Policy, as_policy
from jdp._state import TrainState
from jdp._steps import Metrics, TrainStep
from jdp._tree import PyTree
from jdp.strategies import Strategy, data_parallel, exact, zero1


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    strategy: Strategy | None = None,
    axis_name: str = AXIS_NAME,
    has_aux: bool = False,
    has_model_state: bool = False,
    has_rng: bool = False,
    precision: Policy | DTypeLike | None = None,
    log_grad_norm: bool = False,
    log_learning_rate: bool | Callable[[jax.Array], jax.Array] = False,
    grad_reduce: Literal["mean", "sum"] | None = None,
    accumulate_steps: int | None = None,
    virtual_replicas: int | None = None,
    shard_optimizer: bool | None = None,
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
      log_grad_norm: add ``grad_norm``, the global norm of the reduced,
        unscaled gradients, to the metrics.
      log_learning_rate: add ``learning_rate``, the rate this step used:
        ``True`` reads it from ``optax.inject_hyperparams`` state; an optax
        schedule (the one given to the optimizer) is evaluated at the
        optimizer's own count, which skipped steps do not advance.
      grad_reduce: deprecated, ``strategy=data_parallel(reduce=...)``.
      accumulate_steps: deprecated, ``strategy=data_parallel(accumulate_steps=...)``.
      virtual_replicas: deprecated, ``strategy=exact(virtual_replicas)``.
      shard_optimizer: deprecated, ``strategy=zero1()``.

    Returns:
      A :class:`jdp.TrainStep`. Its metrics hold ``loss`` (this replica's weighted mean,
      float32), ``weight`` (with a ``WeightedLoss``) and the aux entries; with
      a static or dynamic loss scale also ``grads_finite``, ``loss_scale`` (the
      scale this step used) and ``skipped_steps``; with exact mode also
      ``virtual_replica_loss``.

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
    legacy = {
        "grad_reduce": grad_reduce,
        "accumulate_steps": accumulate_steps,
        "virtual_replicas": virtual_replicas,
        "shard_optimizer": shard_optimizer,
    }
    strategy = _strategy(strategy, {k: v for k, v in legacy.items() if v is not None})
    forward = make_forward(loss_fn, as_policy(precision), has_aux, has_model_state, has_rng)
    fn = _build_step(
        forward, strategy, axis_name, has_model_state, has_rng, log_grad_norm, log_learning_rate
    )
    return TrainStep(fn, axis_name, strategy)


def _strategy(strategy: Strategy | None, legacy: dict[str, Any]) -> Strategy:
    """The step's strategy; the deprecated keyword arguments mapped onto one."""
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(
            "make_train_step: strategy must be a jdp.strategies.Strategy, e.g. "
            f"jdp.strategies.zero1(), got {strategy!r:.80}."
        )
    if not legacy:
        return data_parallel() if strategy is None else strategy
    names = ", ".join(f"{k}={v!r}" for k, v in legacy.items())
    if strategy is not None:
        raise ValueError(
            f"make_train_step: {names} and strategy= both choose how gradients cross replicas; "
            "pass the options to the strategy's constructor instead, e.g. "
            "strategy=jdp.strategies.data_parallel(accumulate_steps=2)."
        )
    shard = legacy.pop("shard_optimizer", False)
    if not isinstance(shard, bool):
        raise TypeError(f"make_train_step: shard_optimizer must be a bool, got {shard!r}.")
    g = legacy.pop("virtual_replicas", None)
    options = {"reduce" if k == "grad_reduce" else k: v for k, v in legacy.items()}
    if g is not None and (shard or options):
        raise ValueError(
            f"make_train_step: virtual_replicas (exact mode) does not combine with {names}: "
            "exact mode has its own micro-batches and reduction. Use "
            "strategy=jdp.strategies.exact(virtual_replicas) alone."
        )
    built = exact(g) if g is not None else (zero1 if shard else data_parallel)(**options)
    replacement = {"exact": f"exact({g})", "zero1": "zero1(...)"}.get(
        built.name, "data_parallel(...)"
    )
    warnings.warn(
        f"make_train_step({names}) is deprecated; pass "
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
    log_grad_norm: bool,
    log_learning_rate: bool | Callable[[jax.Array], jax.Array],
) -> Callable[[TrainState, PyTree], tuple[TrainState, Metrics]]:
    """The per-replica step around ``forward``: reduction, update, metrics."""

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        _check_state(state, has_model_state, has_rng)
        out = strategy.gradients(forward, state, batch, axis_name)
        grads = state.loss_scale.unscale(out.grads)
        before = state
        model_state = out.model_state if has_model_state else None
        state, info = strategy.update(state, grads, model_state, axis_name)
        metrics = {"loss": out.loss, **out.aux, **info}
        if out.weight is not None:
            metrics["weight"] = out.weight
        if log_grad_norm:
            metrics["grad_norm"] = strategy.global_norm(grads, before.params, axis_name)
        if log_learning_rate is not False:
            metrics["learning_rate"] = learning_rate(
                log_learning_rate, before.opt_state, state.opt_state
            )
        return state, metrics

    return train_step


def _check_state(state: object, has_model_state: bool, has_rng: bool) -> None:
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
    if has_model_state and state.model_state is None:
        raise ValueError(
            "make_train_step(has_model_state=True) needs model state in the state: "
            "TrainState.create(..., model_state=variables['batch_stats'])."
        )
    for name, leaf in leaves_with_paths(state.params, "state.params"):
        if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
            raise TypeError(
                f"Parameter {name} has dtype {leaf.dtype}; every leaf of params must be "
                "floating to be differentiated. Move integer values (counters, RNG "
                "state) into model_state or out of the state."
            )

"""Exact evaluation: every example counted once, padding never."""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp._args import check_bool, check_name
from jdp._batching import AXIS_NAME, batch_size
from jdp._forward import check_call
from jdp._replication import refuse_consumed
from jdp._steps import EvalStep, TrainStep
from jdp._tree import PyTree
from jdp._weighting import WeightedLoss, weighted_mean
from jdp.backends import Runner
from jdp.strategies import Strategy, data_parallel


def make_eval_step(
    metric_fn: Callable[..., Mapping[str, jax.Array | WeightedLoss]],
    *,
    strategy: Strategy | None = None,
    axis_name: str = AXIS_NAME,
    has_model_state: bool = False,
) -> EvalStep:
    """Builds a per-replica ``(state, batch) -> sums`` for evaluation.

    ``metric_fn(params, batch)`` (with ``model_state=`` when
    ``has_model_state``) returns a dict whose values are either per-example
    arrays of shape ``(b,)`` (each example weighs 1) or
    :class:`jdp.WeightedLoss` sums with their own weight, e.g.
    ``jdp.weighted_mean(per_example, batch["mask"])`` to leave padding out,
    or a per-token mask for per-token metrics. The step sums totals and
    weights over the whole global batch. It reads the state and never
    consumes it: wrapped by :func:`jdp.pmap` or :func:`jdp.shard_map` it does
    not donate. Use :func:`evaluate` to run it over a dataset.

    Args:
      metric_fn: ``(params, batch[, model_state=]) -> dict`` as above.
      strategy: the training step's strategy (default
        :func:`jdp.strategies.data_parallel`): the metric function sees the
        whole parameters under every strategy.
      axis_name: the data axis.
      has_model_state: pass ``state.model_state`` as ``model_state=``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jdp
      >>> evaluator = jdp.shard_map(jdp.make_eval_step(
      ...     lambda p, b: {"err": jnp.abs(b["x"] * p - 1.0)}))
      >>> state = evaluator.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
      >>> jdp.evaluate(evaluator, state, [{"x": np.full(8, 3.0, np.float32)}])["err"]
      2.0
    """
    strategy = data_parallel() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(
            "jdp.make_eval_step: strategy must be a jdp.strategies value (e.g. the training "
            f"step's, train_step.strategy), got {type(strategy).__name__}."
        )

    if not callable(metric_fn):
        raise TypeError(f"jdp.make_eval_step: metric_fn must be callable, got {metric_fn!r}.")
    check_bool(has_model_state, "has_model_state", where="jdp.make_eval_step")
    check_name(axis_name, "axis_name", where="jdp.make_eval_step")
    check_call(metric_fn, ("model_state",) * has_model_state, "jdp.make_eval_step", "metric_fn")

    def eval_step(state, batch):
        extra = {"model_state": state.model_state} if has_model_state else {}
        values = metric_fn(strategy.whole_params(state, axis_name), batch, **extra)
        if not isinstance(values, Mapping):
            raise TypeError(
                f"jdp.make_eval_step: metric_fn must return a dict of per-example arrays or jdp.WeightedLoss "
                f"values, got {type(values).__name__}."
            )
        for reserved, why in _RESERVED.items():
            if reserved in values:
                raise ValueError(
                    f"jdp.make_eval_step: metric_fn returned a metric named {reserved!r}, the key under which {why}; "
                    "rename the metric."
                )
        size = batch_size(batch, "jdp.make_eval_step: the batch")
        sums = {}
        for name, v in values.items():
            if not isinstance(v, WeightedLoss):
                if jnp.shape(v) != (size,):
                    raise ValueError(
                        f"jdp.make_eval_step: metric_fn's {name!r} must have one value per example, shape "
                        f"({size},), or be a jdp.WeightedLoss; got shape {jnp.shape(v)}."
                    )
                v = weighted_mean(v)
            sums[name] = (v.total.astype(jnp.float32), v.weight.astype(jnp.float32))
        return lax.psum(sums, axis_name)

    return EvalStep(eval_step, axis_name, strategy)


WEIGHTS = "weights"  # evaluate's entry for the metrics' total weights
_RESERVED = {
    WEIGHTS: "jdp.evaluate returns each metric's total weight",
    "step": "jdp.fit's evaluation rows (history.eval) hold the step number",
}


def _first_replica(sums: PyTree) -> PyTree:
    """The first local replica's row of per-replica outputs (the sums are global, alike on all).

    Read by position, not by layout: on a one-device mesh JAX gives a
    per-replica output of shape (1, ...) the replicated spec, so a layout
    check would take the row axis for the value.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], sums)


def evaluate(
    wrapped_eval_step: "Runner", state: PyTree, batches: Iterable[PyTree]
) -> dict[str, Any]:
    """Runs a wrapped eval step over host ``batches``; returns exact means.

    The state is only read: it stays valid for further training.

    Args:
      wrapped_eval_step: ``jdp.pmap(make_eval_step(...))`` or
        ``jdp.shard_map(...)``; its ``shard`` method places each batch.
      state: the (replicated) training state.
      batches: host batches, e.g. ``BatchIterator(test, 64, shuffle=False,
        remainder="pad", repeat=False)``, so no example is dropped (the
        metric function leaves the padding out with its ``"mask"``).

    Returns:
      Each metric's weighted mean over the whole dataset, in float64 on the
      host, and ``"weights"``: each metric's total weight (for per-example
      values, the number of examples counted).

    Raises:
      TypeError: the step is not an evaluation step.
      ValueError: the batches held nothing of positive weight.
    """
    inner = getattr(wrapped_eval_step, "step", None)
    if not isinstance(inner, EvalStep):
        what = (
            "a training step (a plain function runs as one: keep an evaluation wrapper's "
            "settings with @jdp.wraps(eval_step)); running it would train on the evaluation data"
            if isinstance(inner, TrainStep)
            else "no jdp step"
        )
        raise TypeError(
            "jdp.evaluate needs a wrapped evaluation step, jdp.pmap(jdp.make_eval_step(metric_fn)) "
            f"(or jdp.shard_map), got {type(wrapped_eval_step).__name__} wrapping {what}."
        )
    refuse_consumed(state, "jdp.evaluate")
    if not isinstance(batches, Iterable) or isinstance(batches, Mapping):
        raise TypeError(
            "jdp.evaluate: batches must be an iterable of host batches (a list, or "
            f"jdp.BatchIterator(..., repeat=False)), got {type(batches).__name__}."
        )
    outs = []
    for batch in batches:
        outs.append(_first_replica(wrapped_eval_step(state, wrapped_eval_step.shard(batch))))
    outs = jax.device_get(outs)  # read back once, after the last batch
    if not outs:
        raise ValueError("jdp.evaluate: the batches were empty; there is nothing to evaluate.")
    result: dict[str, Any] = {}
    weights = {}
    for name in outs[0]:
        total = sum(np.float64(out[name][0]) for out in outs)
        weights[name] = sum(np.float64(out[name][1]) for out in outs)
        if weights[name] <= 0:
            raise ValueError(
                f"jdp.evaluate: metric {name!r} has total weight 0 (no real examples)."
            )
        result[name] = float(total / weights[name])
    result[WEIGHTS] = {name: float(w) for name, w in weights.items()}
    return result

"""Exact evaluation: every example counted once, padding never."""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp.replication import unreplicate
from jdp.sharding import AXIS_NAME, batch_size
from jdp.step import MASK_KEY
from jdp.types import PyTree


def make_eval_step(
    metric_fn: Callable[..., Mapping[str, jax.Array]],
    *,
    axis_name: str = AXIS_NAME,
    has_model_state: bool = False,
):
    """Builds a per-replica ``(state, batch) -> (state, totals)`` for evaluation.

    ``metric_fn(params, batch)`` (with ``model_state=`` when
    ``has_model_state``) returns a dict of **per-example** values of shape
    ``(b,)``. The step sums them over the real examples of the whole global
    batch (the ``"mask"`` entry, when present, excludes padding) and counts
    those examples. The state passes through unchanged, so the step can be
    wrapped by :func:`jdp.pmap` or :func:`jdp.shard_map` like a training step.
    Use :func:`evaluate` to run it over a dataset.
    """

    def eval_step(state, batch):
        extra = {"model_state": state.model_state} if has_model_state else {}
        values = metric_fn(state.params, batch, **extra)
        size = batch_size(batch)
        if not isinstance(values, Mapping):
            raise TypeError(
                f"metric_fn must return a dict of per-example arrays, got {type(values).__name__}."
            )
        for name, v in values.items():
            if jnp.shape(v) != (size,):
                raise ValueError(
                    f"metric_fn's {name!r} must have one value per example, shape "
                    f"({size},), got {jnp.shape(v)}. Return per-example values; jdp "
                    "averages them exactly."
                )
        mask = batch[MASK_KEY] if isinstance(batch, Mapping) and MASK_KEY in batch else None
        weight = jnp.ones(size, jnp.float32) if mask is None else mask.astype(jnp.float32)
        sums = {
            name: lax.psum(jnp.sum(jnp.where(weight > 0, v.astype(jnp.float32), 0.0)), axis_name)
            for name, v in values.items()
        }
        return state, {"sums": sums, "count": lax.psum(jnp.sum(weight), axis_name)}

    eval_step.axis_name = axis_name
    return eval_step


def evaluate(
    wrapped_eval_step, state: PyTree, batches: Iterable[PyTree]
) -> tuple[PyTree, dict[str, Any]]:
    """Runs a wrapped eval step over host ``batches``; returns exact means.

    Args:
      wrapped_eval_step: ``jdp.pmap(make_eval_step(...))`` or
        ``jdp.shard_map(...)``; its ``shard`` method places each batch.
      state: the (replicated) training state; returned, as the step may
        donate it.
      batches: host batches, e.g. ``BatchIterator(test, 64, shuffle=False,
        remainder="pad", repeat=False)``, so no example is dropped.

    Returns:
      ``(state, metrics)``: each metric's mean over every real example, in
      float64 on the host, and ``count``, the number of examples seen.
    """
    outs = []
    for batch in batches:
        state, out = wrapped_eval_step(state, wrapped_eval_step.shard(batch))
        outs.append(unreplicate(out))  # read back once, after the last batch
    outs = jax.device_get(outs)
    count = sum(float(out["count"]) for out in outs)
    if count == 0:
        raise ValueError("evaluate: the batches held no real examples.")
    totals = {name: sum(np.float64(out["sums"][name]) for out in outs) for name in outs[0]["sums"]}
    return state, {**{name: float(t / count) for name, t in totals.items()}, "count": int(count)}

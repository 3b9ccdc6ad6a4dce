"""The ordinary data-parallel strategy: every replica holds everything, one all-reduce."""

from collections.abc import Sequence
from typing import Literal

import jax
from jax import lax

from jdp import _phases
from jdp._args import bound_axis_size, check_int
from jdp._forward import Contribution, Forward, accumulate, replica_rng
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp._weighting import safe_divide, weighted_average
from jdp.strategies._base import (
    PSUM,
    Communication,
    Reduced,
    Strategy,
    check_communication,
    plain_norm,
    refuse_per_replica,
    replicate_state,
    whole_state_update,
)

GradReduce = Literal["mean", "sum"]
GRAD_REDUCTIONS = ("mean", "sum")


def reduce_gradients(
    grads: PyTree,
    axis_name: str,
    grad_reduce: GradReduce = "mean",
    weight: jax.Array | None = None,
    *,
    communication: Communication = PSUM,
) -> PyTree:
    """All-reduces per-replica gradients.

    Args:
      grads: this replica's gradient; of its summed loss when ``weight`` is
        given, of its mean loss otherwise.
      axis_name: the data axis.
      grad_reduce: ``"mean"``: with a weight, the gradients and weights are
        summed over replicas and divided once (the gradient of
        ``sum(totals) / sum(weights)``); without, the mean over replicas.
        ``"sum"``: the sum of per-replica mean gradients (what Chainer's
        ``ParallelUpdater`` and Caffe2's all-reduce compute).
      weight: this replica's weight (:class:`jdp.WeightedLoss`), or None for
        equal replica weights.
      communication: the collectives to sum with (default: ``psum`` in the
        gradients' dtype).

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> f = jax.pmap(lambda g: jdp.reduce_gradients(g, "batch"), axis_name="batch")
      >>> f(jnp.arange(8.0)).tolist()[0]
      3.5
    """
    bound_axis_size(axis_name, "jdp.reduce_gradients")
    if grad_reduce not in GRAD_REDUCTIONS:
        raise ValueError(
            f"jdp.reduce_gradients: unknown grad_reduce={grad_reduce!r}; expected one of "
            f"{GRAD_REDUCTIONS} ('mean': single-device semantics; 'sum': the sum over replicas)."
        )
    if weight is None:
        summed = communication.all_reduce(grads, axis_name)
        if grad_reduce == "sum":
            return summed
        n = lax.axis_size(axis_name)
        return jax.tree.map(lambda g: g / n, summed)  # lax.pmean's arithmetic
    if grad_reduce == "mean":
        summed, total = communication.all_reduce(grads, axis_name), lax.psum(weight, axis_name)
        return jax.tree.map(lambda g: safe_divide(g, total.astype(g.dtype)), summed)
    means = jax.tree.map(lambda g: safe_divide(g, weight.astype(g.dtype)), grads)
    return communication.all_reduce(means, axis_name)


def check_reduce(
    reduce: object, accumulate_steps: object, communication: object, where: str
) -> None:
    """Validates the options data_parallel and zero1 share."""
    if not isinstance(communication, Communication):
        raise TypeError(
            f"{where}: communication must be a jdp.strategies Communication, e.g. "
            f"jdp.strategies.cast_communication(jnp.bfloat16), got {communication!r}."
        )
    if reduce not in GRAD_REDUCTIONS:
        raise ValueError(
            f"{where}: unknown reduce={reduce!r}; expected one of {GRAD_REDUCTIONS} ('mean': "
            "single-device semantics on the global batch; 'sum': sum of per-replica gradients)."
        )
    check_int(accumulate_steps, "accumulate_steps", minimum=1, where=where)


def local_contribution(
    forward: Forward,
    state: TrainState,
    batch: PyTree,
    axis_name: str,
    accumulate_steps: int,
    probe: Forward | None = None,
    split: Sequence[bool] | None = None,
) -> Contribution:
    """This replica's contribution, with its own key per replica and step.

    ``split``: per gradient leaf, whether the forward returns this replica's
    slice of it (fsdp), for :func:`jdp.verify.replay`'s fingerprints.
    """
    rng = None if state.rng is None else replica_rng(state.rng, state.step, axis_name)
    local = accumulate(forward, state, batch, rng, accumulate_steps, axis_name, probe)
    return _phases.mark_contribution(local, axis_name, split=split)


def reduced(
    local: Contribution, grads: PyTree, axis_name: str, split: Sequence[bool] | None = None
) -> Reduced:
    """The step's result from this replica's contribution and the reduced gradients
    (``split``: per leaf, whether this replica holds a slice of it)."""
    model_state = weighted_average(local.model_state, local.weight, axis_name)
    loss = local.total if local.weight is None else safe_divide(local.total, local.weight)
    grads, seen = _phases.mark_gradients(
        _phases.REDUCTION, grads, {"model_state": model_state}, axis_name, split=split
    )
    return Reduced(grads, loss, local.weight, seen["model_state"], local.aux)


def data_parallel(
    *,
    reduce: GradReduce = "mean",
    accumulate_steps: int = 1,
    communication: Communication = PSUM,
) -> Strategy:
    """Every replica holds the whole state; gradients are all-reduced once a step.

    Args:
      reduce: ``"mean"`` (the update equals single-device training on the
        global batch, for any weighting) or ``"sum"`` (the sum of per-replica
        mean gradients, the rule of Chainer's ``ParallelUpdater``).
      accumulate_steps: split each replica's batch into this many
        micro-batches, accumulate their gradients locally and all-reduce once.
      communication: the collectives gradients cross with, e.g.
        :func:`jdp.strategies.cast_communication` for a bfloat16 all-reduce.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> step = jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2),
      ...                            strategy=jdp.strategies.data_parallel(accumulate_steps=2))
      >>> step.strategy.name
      'data_parallel'
    """
    check_reduce(reduce, accumulate_steps, communication, "jdp.strategies.data_parallel")

    def gradients(forward: Forward, state: TrainState, batch: PyTree, axis_name: str) -> Reduced:
        refuse_per_replica(state, "data_parallel", "params")
        check_communication(communication, state, "data_parallel")
        local = local_contribution(forward, state, batch, axis_name, accumulate_steps)
        grads = reduce_gradients(
            local.grads, axis_name, reduce, local.weight, communication=communication
        )
        return reduced(local, grads, axis_name)

    update = whole_state_update("data_parallel")
    return Strategy("data_parallel", gradients, update, plain_norm, replicate_state)

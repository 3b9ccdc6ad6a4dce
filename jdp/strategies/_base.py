"""The strategy protocol: how gradients cross replicas and where state lives.

A :class:`Strategy` is a named tuple of pure functions, built by small
constructors (``data_parallel``, ``zero1``, ``exact``) the way optax builds a
``GradientTransformation``. It owns the five things that differ between modes:
the gradient reduction (``gradients``), the update (``update``), the norm a
global-norm clip must use (``global_norm``), how a state is placed on
devices (``place``) and how XLA must compile the step (``compiler_options``); checkpoints and ``unreplicate`` read a placed state
through :class:`jdp._layout.PerReplica`. The step, the backends, replication,
checkpoints and the loop call these and know no mode.

A :class:`Communication` is the pair of collectives a strategy sums gradients
with, so gradient compression is one value passed to a constructor.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdp import _layout
from jdp._forward import Forward
from jdp._layout import Placement
from jdp._loss_scale import NoOpLossScale
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp._update import apply_gradients
from jdp.metrics import Rule


class Reduced(NamedTuple):
    """What a strategy's ``gradients`` returns: the step's reduced result."""

    grads: PyTree  # reduced over replicas (this replica's slices, for zero1), still loss-scaled
    loss: jax.Array  # this replica's loss (exact mode: the global loss)
    weight: jax.Array | None  # this replica's weight, for a WeightedLoss
    model_state: PyTree  # averaged over replicas
    aux: dict[str, jax.Array]


GradientsFn = Callable[[Forward, TrainState, PyTree, str], Reduced]
UpdateFn = Callable[[TrainState, PyTree, PyTree, str], tuple[TrainState, dict[str, jax.Array]]]
NormFn = Callable[[PyTree, PyTree, str], jax.Array]
PlaceFn = Callable[[TrainState, Placement], TrainState]
ParamsFn = Callable[[TrainState, str], PyTree]


def held_params(state: TrainState, axis_name: str) -> PyTree:
    """``whole_params`` for strategies whose replicas hold the whole parameters."""
    del axis_name
    return state.params


class Strategy(NamedTuple):
    """A way of crossing replicas: a named tuple of pure functions.

    Attributes:
      name: the constructor's name, for messages.
      gradients: ``(forward, state, batch, axis_name) -> Reduced``: this
        replica's forward and backward passes and the gradient reduction.
      update: ``(state, grads, model_state, axis_name) -> (state, metrics)``:
        applies the reduced, unscaled gradients.
      global_norm: ``(grads, params, axis_name) -> norm`` of the reduced
        gradients as this strategy holds them.
      place: ``(state, placement) -> state`` on the devices.
      compiler_options: XLA options the backend compiles the step with, as
        ``(name, value)`` pairs (exact mode needs the same optimization
        passes on every device count; ``docs/exact.md``).
      whole_params: ``(state, axis_name) -> params``: the whole parameters
        inside a step, for the evaluation forward (a strategy that splits
        the parameters gathers them here).
      metric_rules: ``(name, rule)`` pairs for the metrics this strategy
        adds or computes differently (:mod:`jdp.metrics`).
      checks: ``(name, every)`` for each check the step runs every
        ``every`` steps, which a backend may schedule from the host
        (:mod:`jdp._schedule`).
    """

    name: str
    gradients: GradientsFn
    update: UpdateFn
    global_norm: NormFn
    place: PlaceFn
    compiler_options: tuple[tuple[str, str | bool], ...] = ()
    whole_params: ParamsFn = held_params
    metric_rules: tuple[tuple[str, Rule], ...] = ()
    checks: tuple[tuple[str, int], ...] = ()


class Communication(NamedTuple):
    """The collectives gradients are summed with (an encode/decode seam).

    Attributes:
      all_reduce: ``(tree, axis_name) -> tree``: the sum over replicas.
      reduce_scatter: ``(rows, axis_name) -> parts``: for each ``(n, c)``
        array, the sum over replicas of row i on replica i, shape ``(c,)``.
    """

    all_reduce: Callable[[PyTree, str], PyTree]
    reduce_scatter: Callable[[list[jax.Array], str], list[jax.Array]]
    dtype: Any = None  # the dtype floating gradients travel in (None: their own)


def check_communication(communication: Communication, state: TrainState, name: str) -> None:
    """Refuses float16 communication without a loss scale (at trace time).

    float16 sums above 65504 become inf; a loss scale skips such a step and
    lowers the scale, but without one the inf reaches the params (NaN).
    """
    if communication.dtype is None or jnp.dtype(communication.dtype) != jnp.float16:
        return
    if isinstance(state.loss_scale, NoOpLossScale):
        raise ValueError(
            f"jdp.strategies.{name}: float16 gradient communication without a loss scale: "
            "gradient sums above 65504 become inf, and with no loss scale to skip that step "
            "the params become NaN. Communicate in bfloat16 (float32's range: "
            "cast_communication(jnp.bfloat16)), or train with "
            "TrainState.create(..., loss_scale=jdp.DynamicLossScale(...))."
        )


def _psum_scatter(rows: list[jax.Array], axis_name: str) -> list[jax.Array]:
    return [lax.psum_scatter(x, axis_name, scatter_dimension=0) for x in rows]


PSUM = Communication(lambda tree, axis_name: lax.psum(tree, axis_name), _psum_scatter)
"""Sums in the gradients' own dtype (the default)."""


def replicate_state(state: TrainState, placement: Placement) -> TrainState:
    """``place`` for strategies whose replicas all hold the whole state."""
    return placement.replicate(state)


def whole_state_update(name: str) -> UpdateFn:
    """``update`` for strategies whose replicas hold the whole, reduced gradients."""

    def update(state: TrainState, grads: PyTree, model_state: PyTree, axis_name: str):
        del axis_name
        refuse_per_replica(state, name)
        return apply_gradients(state, grads, model_state=model_state)

    return update


def plain_norm(grads: PyTree, params: PyTree, axis_name: str) -> jax.Array:
    """``global_norm`` for strategies whose replicas hold the whole gradients."""
    del params, axis_name
    return optax.tree.norm(grads)


def refuse_per_replica(state: TrainState, name: str, where: str = "state") -> None:
    """Refuses a state placed per replica by another strategy (e.g. zero1's split).

    ``where`` is ``"state"`` (any of it) or ``"params"`` (the parameters only,
    for strategies that split the optimizer state themselves).
    """
    tree = state.params if where == "params" else state
    if _layout.has_per_replica(tree):
        raise TypeError(
            f"jdp.strategies.{name}: the {where} holds values placed per replica by another strategy (split by "
            "jdp.strategies.zero1() or fsdp()), but this step's strategy, "
            f"jdp.strategies.{name}(), holds the whole {where} on every replica. Re-place it: "
            "state = step.replicate(sharded_step.unreplicate(state)), or build this step with "
            "the strategy that placed it."
        )

"""Flax NNX models under jdp: three small functions, no wrapper framework.

An ``nnx.Module`` holds its parameters, its batch statistics and its RNG
state together. jdp's step needs them apart: ``params`` are what the
optimizer updates; everything else is ``model_state`` (averaged across
replicas where floating, returned by the loss). RNG state is kept out of the
computation: jdp hands every replica its own key each step (``has_rng``), and
:func:`merge` reseeds the model's RNG streams from it, so dropout masks differ
per replica and per step while the stored RNG state stays identical on every
replica.

Example:
  >>> import jax, jax.numpy as jnp, optax, jdp
  >>> from flax import nnx

from jdp._tree import is_prng_key
  >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
  >>> graphdef, params, model_state = jdp.nnx.split(model)
  >>> def loss_fn(params, batch, model_state, rng):
  ...     model = jdp.nnx.merge(graphdef, params, model_state, rng=rng)
  ...     return jnp.mean(model(batch) ** 2), jdp.nnx.state(model, model_state)
  >>> step = jdp.pmap(jdp.make_train_step(loss_fn, has_model_state=True, has_rng=True))
  >>> state = step.replicate(jdp.TrainState.create(
  ...     params=params, tx=optax.sgd(0.1), model_state=model_state, rng=jax.random.key(0)))
  >>> state, metrics = step(state, step.shard(jnp.ones((16, 3))))
  >>> metrics["loss"].shape
  (8,)
"""

from typing import Any

import jax

from jdp import _extras

_extras.require(("flax",), "flax", "jdp.nnx")

from flax import nnx  # noqa: E402

from jdp._tree import is_prng_key  # noqa: E402

State = Any
ModelState = tuple[State, State]


def split(model: nnx.Module) -> tuple[nnx.GraphDef, State, ModelState]:
    """``(graphdef, params, model_state)`` of an NNX module.

    ``params`` holds the ``nnx.Param`` variables; ``model_state`` is the pair
    ``(other variables, RNG state)``: batch statistics and any other
    non-parameter variables first, then the RNG keys and counters.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"jdp.nnx.split expects an nnx.Module, got {type(model).__name__}.")
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
    return graphdef, params, (rest, rngs)


def merge(
    graphdef: nnx.GraphDef,
    params: State,
    model_state: ModelState,
    *,
    rng: jax.Array | None = None,
) -> nnx.Module:
    """A fresh module from the pieces :func:`split` returned.

    Args:
      graphdef, params, model_state: as :func:`split` returned them (params
        and model state as the step passes them to the loss).
      rng: this replica's key (the loss's ``rng`` with ``has_rng=True``):
        every RNG stream of the module is reseeded from it, one key per
        stream. None keeps the stored RNG state (evaluation).

    Returns:
      The module, its variables copied so that nothing aliases the arrays the
      step traces. Call ``model.train()`` or ``model.eval()`` as usual.
    """
    if not isinstance(graphdef, nnx.GraphDef):
        raise TypeError(
            "jdp.nnx.merge: graphdef must be the nnx.GraphDef jdp.nnx.split returned, got "
            f"{type(graphdef).__name__}."
        )
    if not isinstance(model_state, tuple) or len(model_state) != 2:
        raise TypeError(
            "jdp.nnx.merge: model_state must be the pair (other variables, RNG state) "
            f"jdp.nnx.split returned (as the step passes it to the loss), got {type(model_state).__name__}."
        )
    rest, rngs = model_state
    model = nnx.merge(graphdef, params, rngs, rest, copy=True)
    if rng is not None:
        streams = sorted(
            {node.tag for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngStream)}
        )
        keys = {tag: jax.random.fold_in(rng, i) for i, tag in enumerate(streams)}
        if keys:
            nnx.reseed(model, **keys)  # type: ignore[arg-type]  # streams by name
    return model


def state(model: nnx.Module, model_state: ModelState) -> ModelState:
    """The new model state to return from the loss: the module's non-parameter
    variables (e.g. updated batch statistics), with the RNG state as it came in,
    so replicas stay identical."""
    if not isinstance(model, nnx.Module):
        raise TypeError(
            "jdp.nnx.state expects the nnx.Module the loss merged (jdp.nnx.merge), got "
            f"{type(model).__name__}."
        )
    _, _, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
    _check_reseeded(rngs, model_state[1])
    return rest, model_state[1]


def _check_reseeded(now: State, stored: State) -> None:
    """Refuses random numbers drawn from the stored RNG state (``merge`` without ``rng``).

    jdp never advances the stored state (every replica keeps it identical), so
    without a per-replica, per-step key every replica and every step would draw
    the same dropout mask. A stream that drew has a new count; one that ``merge``
    reseeded has a new key.
    """
    pairs = list(zip(jax.tree.leaves(now), jax.tree.leaves(stored), strict=True))
    drew = any(a is not b for a, b in pairs if not is_prng_key(a))
    reseeded = any(a is not b for a, b in pairs if is_prng_key(a))
    if drew and not reseeded:
        raise ValueError(
            "jdp.nnx: the module drew random numbers (e.g. dropout) from its stored RNG "
            "state, which jdp.nnx.merge was given no rng= to reseed: every replica and every "
            "step would get the same mask. Build the step with has_rng=True and call "
            "jdp.nnx.merge(graphdef, params, model_state, rng=rng); for evaluation, call "
            "model.eval() first."
        )

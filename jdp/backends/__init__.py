"""Backends: run one per-replica step over the devices, each in its own layout.

A backend is a value, as a strategy is: :func:`shard_map` (the lead backend,
the layout JAX recommends) and :func:`pmap` (the layout of ``jax.pmap``) wrap
the same per-replica step and share one lifecycle (:class:`Backend`). Each
knows its layout (``.layout``), places a state and a batch in it
(``.replicate``, ``.shard``), and re-places a state it receives in the other
backend's layout, so switching backends is one line::

    train_step = jdp.shard_map(step)        # or: jdp.pmap(step)
    state = train_step.replicate(state)
    state, metrics = train_step(state, train_step.shard(batch))
    params = train_step.unreplicate(state).params
"""

from jdp.backends._pmap import PmapStep, pmap
from jdp.backends._runner import Backend, Runner
from jdp.backends._shard_map import ShardMapStep, shard_map

BACKENDS = (shard_map, pmap)
"""Every backend, lead backend first."""

__all__ = ["BACKENDS", "Backend", "PmapStep", "Runner", "ShardMapStep", "pmap", "shard_map"]

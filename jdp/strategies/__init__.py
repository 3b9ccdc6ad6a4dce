"""Strategies: how gradients cross replicas and where the state lives.

Pass one to :func:`jdp.make_train_step` as ``strategy=``; the step, the
backends, checkpoints and the loop work the same with each.
"""

from jdp._layout import Placement
from jdp.strategies._base import PSUM, Communication, Reduced, Strategy
from jdp.strategies._cast import cast_communication
from jdp.strategies._data_parallel import data_parallel
from jdp.strategies._exact import exact
from jdp.strategies._fsdp import Shard, ShardedParams, fsdp, gather, layer
from jdp.strategies._zero1 import ShardedOptState, zero1

__all__ = [
    "PSUM",
    "Communication",
    "Placement",
    "Reduced",
    "Shard",
    "ShardedOptState",
    "ShardedParams",
    "Strategy",
    "cast_communication",
    "data_parallel",
    "exact",
    "fsdp",
    "gather",
    "layer",
    "zero1",
]

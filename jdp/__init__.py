"""jdp: synchronous data-parallel training for JAX."""

from jdp import distributed
from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.data import BatchIterator, prefetch_to_device
from jdp.devices import force_cpu_devices
from jdp.evaluation import evaluate, make_eval_step
from jdp.loop import History, fit
from jdp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)
from jdp.parallel import PmapStep, ShardMapStep, pmap, shard_map
from jdp.replication import (
    assert_replicas_in_sync,
    broadcast,
    gather_replicas,
    replicate,
    replicate_across,
    sync_replicas,
    unreplicate,
)
from jdp.sharding import pad_batch, shard, unshard
from jdp.state import TrainState
from jdp.step import (
    average_model_state,
    cast_floating,
    make_train_step,
    masked_mean,
    reduce_gradients,
    replica_rng,
)
from jdp.types import PyTree

__all__ = [
    "BatchIterator",
    "CheckpointError",
    "Checkpointer",
    "DynamicLossScale",
    "History",
    "LossScale",
    "NoOpLossScale",
    "PmapStep",
    "PyTree",
    "ShardMapStep",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "assert_replicas_in_sync",
    "average_model_state",
    "broadcast",
    "cast_floating",
    "distributed",
    "evaluate",
    "fit",
    "force_cpu_devices",
    "gather_replicas",
    "make_eval_step",
    "make_train_step",
    "masked_mean",
    "pad_batch",
    "pmap",
    "prefetch_to_device",
    "reduce_gradients",
    "replica_rng",
    "replicate",
    "replicate_across",
    "shard",
    "shard_map",
    "sync_replicas",
    "unreplicate",
    "unshard",
]

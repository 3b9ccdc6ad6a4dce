"""jdp: synchronous data-parallel training for JAX."""

from jdp import distributed
from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.data import BatchIterator, prefetch_to_device
from jdp.devices import force_cpu_devices
from jdp.evaluation import evaluate, make_eval_step
from jdp.exact import check_exact
from jdp.loop import History, fit
from jdp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)
from jdp.optimizer_sharding import ShardedOptState, clip_by_global_norm
from jdp.parallel import PmapStep, ShardMapStep, pmap, shard_map
from jdp.precision import Policy
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
from jdp.step import apply_gradients, make_train_step, reduce_gradients, replica_rng
from jdp.tensorboard import TensorBoardLogger
from jdp.types import PyTree
from jdp.version import __version__
from jdp.weighting import WeightedLoss, weighted_mean

__all__ = [
    "BatchIterator",
    "CheckpointError",
    "Checkpointer",
    "DynamicLossScale",
    "History",
    "LossScale",
    "NoOpLossScale",
    "PmapStep",
    "Policy",
    "PyTree",
    "ShardMapStep",
    "ShardedOptState",
    "StaticLossScale",
    "TensorBoardLogger",
    "TrainState",
    "WeightedLoss",
    "__version__",
    "all_finite",
    "apply_gradients",
    "assert_replicas_in_sync",
    "broadcast",
    "check_exact",
    "clip_by_global_norm",
    "distributed",
    "evaluate",
    "fit",
    "force_cpu_devices",
    "gather_replicas",
    "make_eval_step",
    "make_train_step",
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
    "weighted_mean",
]

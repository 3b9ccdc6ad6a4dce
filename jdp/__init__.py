"""jdp: synchronous data-parallel training for JAX."""

from jdp import backends, distributed, metrics, strategies
from jdp._audit import Audit, ReplicaMismatchError
from jdp._batching import pad_batch, shard, unshard
from jdp._checkpoint import Checkpointer, CheckpointError
from jdp._data import BatchIterator, prefetch_to_device
from jdp._devices import force_cpu_devices
from jdp._evaluation import evaluate, make_eval_step
from jdp._forward import replica_rng
from jdp._loop import History, fit
from jdp._loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)
from jdp._precision import Policy
from jdp._replication import (
    assert_replicas_in_sync,
    broadcast,
    gather_replicas,
    replicate,
    replicate_across,
    sync_replicas,
    unreplicate,
)
from jdp._state import TrainState
from jdp._step import make_train_step
from jdp._steps import EvalStep, TrainStep, wraps
from jdp._tensorboard import TensorBoardLogger
from jdp._tree import PyTree, dataclass, static_field
from jdp._update import apply_gradients
from jdp._version import __version__
from jdp._weighting import WeightedLoss, weighted_mean
from jdp.backends import PmapStep, ShardMapStep, pmap, shard_map
from jdp.strategies._data_parallel import reduce_gradients
from jdp.strategies._zero1 import ShardedOptState, clip_by_global_norm
from jdp.testing import check_exact

__all__ = [
    "Audit",
    "BatchIterator",
    "CheckpointError",
    "Checkpointer",
    "DynamicLossScale",
    "EvalStep",
    "History",
    "LossScale",
    "NoOpLossScale",
    "PmapStep",
    "Policy",
    "PyTree",
    "ReplicaMismatchError",
    "ShardMapStep",
    "ShardedOptState",
    "StaticLossScale",
    "TensorBoardLogger",
    "TrainState",
    "TrainStep",
    "WeightedLoss",
    "__version__",
    "all_finite",
    "apply_gradients",
    "assert_replicas_in_sync",
    "backends",
    "broadcast",
    "check_exact",
    "clip_by_global_norm",
    "dataclass",
    "distributed",
    "evaluate",
    "fit",
    "force_cpu_devices",
    "gather_replicas",
    "make_eval_step",
    "make_train_step",
    "metrics",
    "pad_batch",
    "pmap",
    "prefetch_to_device",
    "reduce_gradients",
    "replica_rng",
    "replicate",
    "replicate_across",
    "shard",
    "shard_map",
    "static_field",
    "strategies",
    "sync_replicas",
    "unreplicate",
    "unshard",
    "weighted_mean",
    "wraps",
]

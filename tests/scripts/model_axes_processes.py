"""Exact mode on a ("batch", "model") mesh under `python -m jdp.launch`, for tests/test_model_axes.py.

python -m jdp.launch --processes P --devices-per-process M tests/scripts/model_axes_processes.py OUT

The mesh is (P * M // 2, 2): each process's devices form whole model groups,
and the data axis spans the processes. Kernels are split over "model". After
5 steps the state is checkpointed, restored and compared; process 0 writes
the parameters and the losses to OUT.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jdp  # noqa: E402
from tests import models  # noqa: E402
from tests.test_model_axes import lm_tx, split_state  # noqa: E402


def main(out):
    devices = np.asarray(jax.devices()).reshape(-1, 2)  # process order: groups stay within one
    mesh = Mesh(devices, ("batch", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    step = jdp.shard_map(
        jdp.make_train_step(models.lm_loss, strategy=jdp.strategies.exact(8)), mesh=mesh
    )
    initial = jdp.TrainState.create(params=models.lm_params(), tx=lm_tx())
    state = step.replicate(initial)
    state = split_state(state, mesh)
    mine = slice(16 // jax.process_count() * jax.process_index(), None)
    losses = []
    for i in range(5):
        tokens = models.lm_batch(16, seed=i)["tokens"][mine][: 16 // jax.process_count()]
        state, metrics = step(state, step.shard({"tokens": tokens}))
        losses.append(np.asarray(jdp.gather_replicas(metrics)["loss"]))
    jdp.assert_replicas_in_sync(state)
    with jdp.Checkpointer(f"{out}-ckpt") as checkpoints:
        checkpoints.save(5, state)
        restored, _ = checkpoints.restore(state)
    assert restored.params["head"].sharding == state.params["head"].sharding
    a, b = jdp.unreplicate(state), jdp.unreplicate(restored)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if jax.process_index() == 0:
        leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(a.params))}
        np.savez(out, losses=np.stack(losses), **leaves)
    print("done", jax.process_index(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

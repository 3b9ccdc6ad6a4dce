"""Training under `python -m jdp.launch`, for tests/test_distributed.py.

python -m jdp.launch --processes P --devices-per-process M tests/multiprocess_train.py OUT BACKEND

Each process seeds its parameters differently; replicate makes them all
start from process 0's. Each process reads its slice of every global batch.
After 20 steps the state is checkpointed (once, for the whole job), restored
on every process and compared; process 0 writes params and losses to OUT.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
from tests import models  # noqa: E402


def main(out, backend):
    wrap = jdp.pmap if backend == "pmap" else jdp.shard_map
    step = wrap(jdp.make_train_step(models.mlp_loss))
    mine = jdp.TrainState.create(
        params=models.mlp_params(seed=jax.process_index()),
        tx=optax.adam(1e-2),
        loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**10), period=5),
    )
    state = step.replicate(mine)
    jdp.assert_replicas_in_sync(state)
    start = jax.tree.map(np.asarray, jdp.unreplicate(state).params)
    expected = models.mlp_params(seed=0)
    jax.tree.map(np.testing.assert_array_equal, start, jax.tree.map(np.asarray, expected))

    data = jdp.BatchIterator(models.regression_batch(256, seed=9), 32, seed=0)
    losses = []
    for _ in range(20):
        state, metrics = step(state, step.shard(next(data)))
        losses.append(jdp.gather_replicas(metrics)["loss"])
    jdp.assert_replicas_in_sync(state)

    with jdp.Checkpointer(f"{out}-ckpt") as ckpt:
        ckpt.save(20, state, extra={"data": data.get_state()})
        restored, extra = ckpt.restore(step.replicate(mine))
    jdp.assert_replicas_in_sync(restored)
    a, b = jdp.unreplicate(state), jdp.unreplicate(restored)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.params), jax.device_get(b.params))
    assert extra["data"]["iteration"] == 20

    if jax.process_index() == 0:
        params = jax.device_get(a.params)
        np.savez(out, losses=np.stack(losses), **{k: np.asarray(v) for k, v in params.items()})
    print("done", jax.process_index(), np.stack(losses).shape, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""A job that fails, stalls or is terminated, under any launcher, for tests/test_failfast.py.

python tests/multiprocess_failfast.py MODE OUT   (under jdp.launch, srun, mpirun or alone)

MODE is ``ok``, ``raise`` (process 1 raises while loading the batch of step 3),
``short`` (process 1 leaves the loop after 3 steps) or ``sleep`` (every
process trains slowly until terminated). Each process writes its pid to
OUT-<index>.pid, and the time of its failure to OUT-<index>.failed_at; with
``ok`` process 0 writes the final params to OUT.npz.
"""

import os
import sys
import time

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
from tests import models  # noqa: E402


def batches(mode, out, rank):
    data = jdp.BatchIterator(models.regression_batch(256, seed=9), 32, seed=0)
    for i, batch in enumerate(data, start=1):
        if mode == "raise" and rank == 1 and i == 3:
            with open(f"{out}-{rank}.failed_at", "w") as f:
                f.write(str(time.time()))
            raise RuntimeError("process 1 fails on purpose while loading")
        if mode == "sleep":
            time.sleep(0.2)
        yield batch


def main(mode, out):
    rank = jax.process_index()
    with open(f"{out}-{rank}.pid", "w") as f:
        f.write(str(os.getpid()))
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(
        jdp.TrainState.create(params=models.mlp_params(seed=rank), tx=optax.adam(1e-2))
    )
    if mode == "short" and rank == 1:  # a loop of its own, 3 steps, then the script ends
        for batch, _ in zip(batches(mode, out, rank), range(3), strict=False):
            state, metrics = step(state, step.shard(batch))
        jax.block_until_ready(metrics)
        with open(f"{out}-{rank}.failed_at", "w") as f:
            f.write(str(time.time()))  # it leaves the loop: the others wait from now
    else:
        steps = 10_000 if mode == "sleep" else 8
        state, _ = jdp.fit(step, state, batches(mode, out, rank), num_steps=steps, progress=False)
    if mode == "ok" and rank == 0:
        np.savez(f"{out}.npz", **jax.device_get(jdp.unreplicate(state).params))
    print("finished", rank, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

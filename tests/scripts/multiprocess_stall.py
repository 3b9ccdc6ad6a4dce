"""Processes that disagree on the number of steps, for tests/test_misuse.py.

python -m jdp.launch --processes 2 --devices-per-process 2 tests/multiprocess_stall.py PIDS

Process 0 runs 5 steps, process 1 runs 3: process 0 waits forever in the
collective of step 4 unless the job is ended. Each process writes its pid to
PIDS-<index> first.
"""

import os
import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

with open(f"{sys.argv[1]}-{jax.process_index()}", "w") as f:
    f.write(str(os.getpid()))
step = jdp.pmap(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
for i in range(5 if jax.process_index() == 0 else 3):
    state, metrics = step(state, step.shard(np.ones(4, np.float32)))
    jax.block_until_ready(metrics)
    print("step", i, flush=True)

"""Restore agreement across processes, for tests/test_misuse.py.

python -m jdp.launch --processes 2 --devices-per-process 2 tests/multiprocess_restore.py DIR

Both processes save checkpoints 1 and 2; then process 1 alone cannot read
checkpoint 2 (a read error injected on that process only). Every process
must restore the same step, 1, with the same extra, and say so.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

directory = sys.argv[1]
state = jdp.replicate(jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1)))
with jdp.Checkpointer(directory) as ckpt:
    ckpt.save(1, state, extra={"data": {"position": 1}})
    ckpt.save(2, state, extra={"data": {"position": 2}})

ckpt = jdp.Checkpointer(directory)
if jax.process_index() == 1:
    read = ckpt._read_metadata

    def flaky(step):
        if step == 2:
            return None, OSError("injected read error on process 1")
        return read(step)

    ckpt._read_metadata = flaky
restored, extra = ckpt.restore(state)
print("restored", extra["data"]["position"], flush=True)
ckpt.close()

"""An uncaught exception right after an async save, for tests/test_misuse.py.

python -m jdp.launch --processes 1 tests/multiprocess_crash_save.py DIR

jdp.launch's handler exits at once on an uncaught exception (os._exit skips
atexit); the in-flight checkpoint must still be finished.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

state = jdp.replicate(jdp.TrainState.create(params=jnp.ones((512, 512)), tx=optax.adam(0.1)))
ckpt = jdp.Checkpointer(sys.argv[1], async_save=True)
ckpt.save(7, state)
raise RuntimeError("boom right after an async save")

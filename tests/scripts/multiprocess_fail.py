"""A job in which process 1 fails while process 0 waits in a collective.

python -m jdp.launch --processes 2 tests/multiprocess_fail.py PIDDIR
Each process writes its pid to PIDDIR; without the launcher stopping it,
process 0 would wait for process 1 forever.
"""

import os
import pathlib
import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

pathlib.Path(sys.argv[1], f"{jax.process_index()}.pid").write_text(str(os.getpid()))
if jax.process_index() == 1:
    raise RuntimeError("process 1 fails on purpose")
multihost_utils.sync_global_devices("wait for process 1")
multihost_utils.broadcast_one_to_all(jnp.ones(3))

"""Each process names its own checkpoint folder, for tests/test_distributed.py."""

import sys

import jax

import jdp

jdp.distributed.initialize()
try:
    jdp.Checkpointer(f"{sys.argv[1]}/{jax.process_index()}")
except ValueError as e:
    print("refused:", e, flush=True)
    sys.exit(3)

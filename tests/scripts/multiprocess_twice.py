"""Calls jdp.distributed.initialize() twice, for tests/test_distributed.py."""

import jdp.distributed

jdp.distributed.initialize()
try:
    jdp.distributed.initialize()
except RuntimeError as e:
    print("second call:", e, flush=True)

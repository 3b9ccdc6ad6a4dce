"""Exact mode across processes, for tests/test_exact.py.

python -m jdp.launch --processes P --devices-per-process M tests/multiprocess_exact.py OUT BACKEND

20 Adam steps of an MLP with dropout, strategies.exact(8); process 0 writes
the final params and the last loss to OUT.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdp  # noqa: E402
from tests import test_exact  # noqa: E402


def main(out, backend):
    wrap = jdp.pmap if backend == "pmap" else jdp.shard_map
    step = wrap(test_exact.exact_step())
    state = step.replicate(test_exact.initial_state())
    data = jdp.BatchIterator(test_exact.DATA, 64, seed=0)
    for _ in range(20):
        state, metrics = step(state, step.shard(next(data)))
    final = jdp.unreplicate(state)
    if jax.process_index() == 0:
        params = jax.device_get(final.params)
        loss = np.asarray(jdp.gather_replicas(metrics)["loss"])
        np.savez(out, loss=loss, **{k: np.asarray(v) for k, v in params.items()})
    else:
        jdp.gather_replicas(metrics)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

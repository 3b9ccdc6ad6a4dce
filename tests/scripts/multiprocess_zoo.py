"""The exact-mode model zoo across processes, for tests/test_zoo_processes.py.

python -m jdp.launch --processes P --devices-per-process M tests/multiprocess_zoo.py OUT

Trains the zoo families for their few steps (``zoo.ACROSS_PROCESSES``); process 0
writes each backend's and family's final state leaves and last loss to OUT.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdp  # noqa: E402
from jdp._tree import is_prng_key  # noqa: E402
from tests import zoo  # noqa: E402


def train(family, backend):
    make_step, state, batches = zoo.FAMILIES[family]()
    step = (jdp.pmap if backend == "pmap" else jdp.shard_map)(make_step())
    placed = step.replicate(state)
    for batch in batches:
        placed, metrics = step(placed, step.shard(_this_process_rows(batch)))
    final = jdp.unreplicate(placed)
    loss = jdp.gather_replicas(metrics)["loss"]
    return jax.device_get((final, loss))


def _this_process_rows(batch):
    """This process's contiguous block of the global batch (what jdp.BatchIterator feeds)."""
    size = len(jax.tree.leaves(batch)[0]) // jax.process_count()
    lo = jax.process_index() * size
    return jax.tree.map(lambda x: x[lo : lo + size], batch)


def main(out):
    arrays = {}
    for backend, families in zoo.ACROSS_PROCESSES.items():
        for family in families:
            final, loss = train(family, backend)
            prefix = f"{backend}/{family}"
            for path, leaf in jax.tree_util.tree_flatten_with_path(final)[0]:
                value = jax.random.key_data(leaf) if is_prng_key(leaf) else leaf
                arrays[f"{prefix}/{jax.tree_util.keystr(path)}"] = np.asarray(value)
            arrays[f"{prefix}/loss"] = np.asarray(loss)
    if jax.process_index() == 0:
        np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])

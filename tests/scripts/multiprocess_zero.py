"""A split state across processes, for tests/test_zero1.py, test_fsdp.py and test_exact_sharded.py.

python -m jdp.launch --processes P --devices-per-process M tests/multiprocess_zero.py OUT BACKEND CKPT [STRATEGY]

STRATEGY: zero1 (the default), fsdp, exact_split (exact(8, shard_optimizer_state=True)),
or fsdp_stacked (fsdp(stacked=...) on the transformer LM whose blocks run in a scan).

10 Adam steps with the optimizer state split over every process's devices, a
checkpoint (the whole state, gathered from every process's slices), a restore
into a fresh state and 10 more steps; process 0 writes the final params, the
whole optimizer state and the last losses to OUT.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
from tests import models, test_zero1  # noqa: E402


def main(out, backend, directory, strategy="zero1"):
    wrap = jdp.pmap if backend == "pmap" else jdp.shard_map
    loss, params, examples = (
        models.mlp_loss,
        test_zero1.PARAMS,
        models.regression_batch(512, seed=7),
    )
    if strategy == "exact_split":
        chosen = jdp.strategies.exact(8, shard_optimizer_state=True)
    elif strategy == "fsdp_stacked":
        chosen = jdp.strategies.fsdp(stacked=models.in_blocks)
        loss, params = models.lm_scan_loss, models.stacked(models.lm_params(layers=3))
        examples = models.lm_batch(512, seed=7)
    else:
        chosen = getattr(jdp.strategies, strategy)()
    step = wrap(jdp.make_train_step(loss, strategy=chosen))
    fresh = jdp.TrainState.create(params=params, tx=optax.adam(1e-2))
    state = step.replicate(fresh)
    data = jdp.BatchIterator(examples, 64, seed=0)
    for _ in range(10):
        state, _ = step(state, step.shard(next(data)))
    with jdp.Checkpointer(directory) as ckpt:
        ckpt.save(10, state)
        ckpt.wait_until_finished()
        state, _ = ckpt.restore(step.replicate(fresh))
    for _ in range(10):
        state, metrics = step(state, step.shard(next(data)))
    final = jax.device_get(step.unreplicate(state))
    losses = np.asarray(jdp.gather_replicas(metrics)["loss"])
    if jax.process_index() == 0:
        leaves = jax.tree_util.tree_flatten_with_path((final.params, final.opt_state))[0]
        arrays = {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}
        np.savez(out, loss=np.sort(losses), **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])

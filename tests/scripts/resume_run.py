"""A training run with checkpoints, for the kill-and-resume test.

python tests/resume_run.py DIR STEPS [--resume]: trains STEPS steps of an MLP
with Adam and a dynamic loss scale on 8 CPU devices, checkpointing every 5
steps (asynchronously) with the BatchIterator's position in `extra`, and
writes the final params to DIR/final.npz. Two examples carry an inf, so the
loss scale moves and the two steps that draw them are skipped.
"""

import sys

import jax

import jdp

jdp.force_cpu_devices(8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests import models  # noqa: E402


def dataset():
    data = models.regression_batch(200, seed=1000)
    data["x"][[17, 150], 0] = np.inf  # every epoch, two batches overflow
    return data


def main(directory, steps, resume):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(
        jdp.TrainState.create(
            params=models.mlp_params(),
            tx=optax.adam(1e-2),
            loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**10), period=4, min_loss_scale=2.0),
            rng=jax.random.key(3),
        )
    )
    data = jdp.BatchIterator(dataset(), 32, seed=4)
    with jdp.Checkpointer(f"{directory}/ckpt", max_to_keep=2, async_save=True) as ckpt:
        if resume:
            state, extra = ckpt.restore(state)
            data.set_state(extra["data"])
            print("resumed", data.iteration, flush=True)
        while data.iteration < steps:
            state, _ = step(state, step.shard(next(data)))
            if data.iteration % 5 == 0:
                ckpt.save(data.iteration, state, extra={"data": data.get_state()})
            print("step", data.iteration, flush=True)
    final = jdp.unreplicate(state)
    np.savez(
        f"{directory}/final.npz",
        skipped=np.asarray(final.skipped_steps),
        scale=np.asarray(final.loss_scale.loss_scale),
        **{k: np.asarray(v) for k, v in final.params.items()},
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--resume" in sys.argv)

"""A jdp.fit run over grain or a custom iterator, for the kill-and-resume tests.

python tests/fit_resume_run.py DIR STEPS KIND

KIND is "grain" (source -> shuffle -> batch, this process's shard) or
"custom" (an iterator of our own with get_state/set_state). fit checkpoints
every 5 steps and resumes from DIR/ckpt when it exists; a callback prints
"step N" after every step; the final params go to DIR/final.npz.
"""

import sys

import jax

import jdp

jdp.force_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests import models  # noqa: E402

DATA = models.regression_batch(200, seed=1001)


class Records:
    """A random-access source: one dict per example."""

    def __len__(self):
        return len(DATA["x"])

    def __getitem__(self, i):
        return {"x": DATA["x"][i], "y": DATA["y"][i]}


def grain_batches(batch_size, seed):
    import grain

    ds = grain.MapDataset.source(Records()).shuffle(seed=seed).repeat()
    ds = ds[jax.process_index() :: jax.process_count()]  # this process's examples
    local = batch_size // jax.process_count()
    return iter(ds.batch(local, drop_remainder=True).to_iter_dataset())


class Counted:
    """Any iterator with get_state()/set_state() resumes exactly under fit."""

    def __init__(self, batch_size, seed):
        self.batch_size, self.seed, self.i = batch_size, seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        rows = np.random.default_rng([self.seed, self.i]).choice(
            200, self.batch_size, replace=False
        )
        self.i += 1
        return {"x": DATA["x"][rows], "y": DATA["y"][rows]}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def main(directory, steps, kind):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    data = grain_batches(32, seed=5) if kind == "grain" else Counted(32, seed=5)
    with jdp.Checkpointer(f"{directory}/ckpt", max_to_keep=2) as ckpt:
        state, _ = jdp.fit(
            step,
            state,
            data,
            num_steps=steps,
            checkpointer=ckpt,
            checkpoint_every=5,
            callbacks=[lambda row: print("step", row["step"], flush=True)],
            log_every=1,
            progress=False,
        )
    params = jdp.unreplicate(state).params
    np.savez(f"{directory}/final.npz", **{k: np.asarray(v) for k, v in params.items()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

"""An exact-mode jdp.fit job that may be preempted or fail, for tests/test_restarts.py.

python tests/preempt_run.py DIR STEPS   (alone, or under python -m jdp.launch)

Trains an MLP in exact mode (the same bits on any layout) with fit, saving to
DIR/ckpt every 5 steps and resuming from it; prints "step N" after every step
(slowly, so a test can send a signal mid-run) and writes the final params to
DIR/final.npz. Each process writes its pid to DIR/pid-<index>. With
$FAIL_AT="P:S[,P:S...]", process P raises at step S, once per DIR (a marker
file remembers it) unless $FAIL_ALWAYS is set.
"""

import os
import pathlib
import sys
import time

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
from tests import models  # noqa: E402


def failing_callback(directory):
    """Raises at each "P:S" of $FAIL_AT (comma-separated), once per DIR unless $FAIL_ALWAYS."""
    specs = [
        tuple(map(int, spec.split(":")))
        for spec in os.environ.get("FAIL_AT", "").split(",")
        if spec
    ]

    def callback(row):
        for process, step in specs:
            marker = directory / f"failed-{process}-{step}"
            here = jax.process_index() == process and row["step"] == step
            if here and (os.environ.get("FAIL_ALWAYS") or not marker.exists()):
                marker.touch()
                raise RuntimeError(f"injected failure at step {step}")

    return callback


def main(directory, steps):
    directory = pathlib.Path(directory)
    (directory / f"pid-{jax.process_index()}").write_text(str(os.getpid()))
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(8)))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    data = jdp.BatchIterator(models.regression_batch(256, seed=7), 32, seed=3)

    def report(row):
        print("step", row["step"], flush=True)
        time.sleep(0.05)

    with jdp.Checkpointer(directory / "ckpt", max_to_keep=3) as ckpt:
        state, _ = jdp.fit(
            step,
            state,
            data,
            num_steps=steps,
            checkpointer=ckpt,
            checkpoint_every=5,
            callbacks=[report, failing_callback(directory)],
            log_every=1,
            progress=False,
        )
    if jax.process_index() == 0:
        final = jax.device_get(jdp.unreplicate(state))
        np.savez(directory / "final.npz", *jax.tree.leaves((final.params, final.opt_state)))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

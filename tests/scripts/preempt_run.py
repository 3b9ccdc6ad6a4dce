"""An exact-mode jdp.fit job that may be preempted or fail, for tests/test_restarts.py.

python tests/preempt_run.py DIR STEPS   (alone, or under python -m jdp.launch)

Trains an MLP in exact mode (the same bits on any layout; another strategy
with $STRATEGY=data_parallel, zero1 or fsdp) with fit, saving to
DIR/ckpt every 5 steps and resuming from it; prints "step N" after every step
(slowly, so a test can send a signal mid-run) and writes the final params to
DIR/final.npz. Each process writes its pid to DIR/pid-<index>. With
$FAIL_AT="P:S[,P:S...]", process P raises at step S, once per DIR (a marker
file remembers it) unless $FAIL_ALWAYS is set; with $KILL_AT="P:S", process P
kills itself (SIGKILL) at step S, once per DIR ($KILL_SETTLE seconds after
its row of step S is read back, so the step after it can complete on every
process first). With $LOCAL set, the
checkpointer keeps the survivors' copy in DIR/local (and the step does not
donate its state). $BACKEND=shard_map runs the step under jdp.shard_map
(default jdp.pmap). With $RECORD=PATH each process appends each batch's
iterator position and example ids to PATH-<index>. Each process appends
"STEP TIME" to DIR/steps-<index> as each step's row is read back.
"""

import os
import pathlib
import signal
import sys
import time

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402
from tests import models  # noqa: E402

STRATEGIES = {
    "exact": lambda: jdp.strategies.exact(8),
    "data_parallel": jdp.strategies.data_parallel,
    "zero1": jdp.strategies.zero1,
    "fsdp": jdp.strategies.fsdp,  # the MLP's kernels split 1/n, across the processes
}


def failing_callback(directory):
    """Raises at each "P:S" of $FAIL_AT (comma-separated), once per DIR unless $FAIL_ALWAYS;
    SIGKILLs itself at each "P:S" of $KILL_AT, once per DIR."""

    def specs(name):
        return [tuple(map(int, s.split(":"))) for s in os.environ.get(name, "").split(",") if s]

    fails, kills = specs("FAIL_AT"), specs("KILL_AT")

    def callback(row):
        for process, step in kills:
            marker = directory / f"killed-{process}-{step}"
            if jax.process_index() == process and row["step"] == step and not marker.exists():
                time.sleep(float(os.environ.get("KILL_SETTLE", "0")))
                marker.write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        for process, step in fails:
            marker = directory / f"failed-{process}-{step}"
            here = jax.process_index() == process and row["step"] == step
            if here and (os.environ.get("FAIL_ALWAYS") or not marker.exists()):
                marker.touch()
                raise RuntimeError(f"injected failure at step {step}")

    return callback


class Recorded:
    """A BatchIterator that appends each batch's example ids to a log ($RECORD)."""

    def __init__(self, data, log):
        self.data, self.log = data, log

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.data)
        with open(self.log, "a") as f:
            f.write(f"{self.data.get_state()['iteration']} {batch['id'].tolist()}\n")
        return batch

    def get_state(self):
        return self.data.get_state()

    def set_state(self, state):
        self.data.set_state(state)


def main(directory, steps):
    directory = pathlib.Path(directory)
    (directory / f"pid-{jax.process_index()}").write_text(str(os.getpid()))
    strategy = STRATEGIES[os.environ.get("STRATEGY", "exact")]()
    local = directory / "local" if os.environ.get("LOCAL") else None
    train_step = jdp.make_train_step(models.mlp_loss, strategy=strategy)
    wrap = jdp.shard_map if os.environ.get("BACKEND") == "shard_map" else jdp.pmap
    step = wrap(train_step, donate_state=False if local else None)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    examples = models.regression_batch(256, seed=7)
    data = jdp.BatchIterator({**examples, "id": np.arange(256)}, 32, seed=3)
    if os.environ.get("RECORD"):
        data = Recorded(data, f"{os.environ['RECORD']}-{jax.process_index()}")

    def report(row):
        print("step", row["step"], flush=True)
        with open(directory / f"steps-{jax.process_index()}", "a") as f:
            f.write(f"{row['step']} {time.time()}\n")  # when each step's row was read back
        time.sleep(0.05)

    with jdp.Checkpointer(directory / "ckpt", max_to_keep=3, local_directory=local) as ckpt:
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
    final = jax.device_get(jdp.unreplicate(state))  # a collective under fsdp: every process
    if jax.process_index() == 0:
        np.savez(directory / "final.npz", *jax.tree.leaves((final.params, final.opt_state)))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

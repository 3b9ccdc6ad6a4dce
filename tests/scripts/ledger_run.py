"""A fit run that dies part way, for tests/test_ledger.py.

python tests/scripts/ledger_run.py DIR STEPS DIE_AT: trains an MLP on 8 CPU
devices with fit, checkpointing every 10 steps into DIR/ckpt and logging every
step; when the row of step DIE_AT is logged it exits at once with status 3, as
a killed process would (no save, no clean-up). DIE_AT 0: never. Writes the
wall time at fit's start to DIR/start-<pid>.txt and, when it finishes, the
start, the end and the history's ledger to DIR/times-<pid>.json.
"""

import json
import os
import sys
import time

import jdp

jdp.force_cpu_devices(8)

import optax  # noqa: E402

from tests import models  # noqa: E402


def main(directory, steps, die_at):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))

    def die(row):
        if row["split"] == "train" and row["step"] == die_at:
            os._exit(3)

    with jdp.Checkpointer(f"{directory}/ckpt") as ckpt:
        times = {"start": time.time()}
        with open(f"{directory}/start-{os.getpid()}.txt", "w") as f:
            f.write(str(times["start"]))  # a run that dies writes nothing else
        _, history = jdp.fit(
            step,
            state,
            jdp.BatchIterator(models.regression_batch(256, seed=2), 32, seed=0),
            num_steps=steps,
            checkpointer=ckpt,
            checkpoint_every=10,
            callbacks=[die],
            log_every=1,
            progress=False,
        )
        times["end"] = time.time()
    times["ledger"] = history.time
    with open(f"{directory}/times-{os.getpid()}.json", "w") as f:
        json.dump(times, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

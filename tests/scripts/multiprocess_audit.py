"""jdp.Audit across processes, for tests/test_audit.py.

python -m jdp.launch --processes 2 --devices-per-process 2 tests/scripts/multiprocess_audit.py OUT MODE

MODE "faults": 20 random one-bit faults, each in a fresh exact-mode state, on
any replica of any process; process 0 writes each fault and the audit result
the step returned (the same on every replica) to OUT. MODE "stop": one fault
on replica 3 (process 1) with on_mismatch="stop"; the job must end. MODE
"recompute": 20 random faults in one device's gradients under exact mode's
recompute_every=1; process 0 writes each expected and returned row.
"""

import sys

import jdp.distributed

jdp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdp  # noqa: E402
from tests import models, test_audit  # noqa: E402


def recompute(out):
    from tests import test_recompute

    step = jdp.shard_map(test_recompute.per_replica(audit=jdp.Audit(on_mismatch="warn")))
    rng = np.random.default_rng(4)
    found = []
    for _ in range(20):
        fault, expected = test_recompute.random_fault(rng, 4)
        found.append([expected, test_recompute.faulty_run(step, fault)])
    devices = [d.process_index for d in step.mesh.devices.flat]
    if jax.process_index() == 0:
        np.savez(out, found=np.asarray(found), processes=np.asarray(devices))


def main(out, mode):
    if mode == "recompute":
        return recompute(out)
    policy = "stop" if mode == "stop" else "warn"
    step = jdp.shard_map(
        jdp.testing.with_faults(
            jdp.make_train_step(
                models.mlp_loss,
                strategy=jdp.strategies.exact(8),
                audit=jdp.Audit(on_mismatch=policy),
            )
        )
    )
    state0 = test_audit.initial_state()
    batch = models.regression_batch(test_audit.BATCH, seed=5)
    if mode == "stop":
        state = step.replicate(state0)
        for i in range(3):
            fault = jdp.testing.Fault(2, 3, 1, 0, 30)
            rows = (
                fault.rows(test_audit.BATCH) if i == 1 else jdp.testing.no_fault(test_audit.BATCH)
            )
            state, _ = step(state, step.shard((batch, rows)))
        step.check_audit()
        print("not reached", flush=True)
        return
    rng = np.random.default_rng(3)
    leaves = test_audit.candidate_leaves(state0)
    found = []
    for _ in range(20):
        fault = [
            1,
            int(rng.integers(4)),
            int(rng.choice(leaves)),
            int(rng.integers(3)),
            int(rng.integers(32)),
        ]
        state = step.replicate(state0)
        _, metrics = step(
            state, step.shard((batch, jdp.testing.Fault(*fault).rows(test_audit.BATCH)))
        )
        result = jdp.gather_replicas(metrics)["audit"]
        found.append(fault + np.asarray(result).reshape(4, 4)[0].tolist())
    devices = [d.process_index for d in step.mesh.devices.flat]
    if jax.process_index() == 0:
        np.savez(out, found=np.asarray(found), processes=np.asarray(devices))


if __name__ == "__main__":
    main(*sys.argv[1:])

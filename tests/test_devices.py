"""force_cpu_devices: safe thread pool, clear errors, and long runs without a hang."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

import jdp

LONG_RUN = textwrap.dedent(
    """
    import jax
    import jdp
    jdp.force_cpu_devices(8)
    import os, numpy as np, optax
    from tests import models

    assert os.environ["PJRT_NPROC"] == "16", os.environ["PJRT_NPROC"]
    data = models.regression_batch(64)
    for backend in (jdp.pmap, jdp.shard_map):
        step = backend(jdp.make_train_step(models.mlp_loss))
        state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-3)))
        batch = step.shard(data)
        for _ in range({steps}):  # no blocking: dispatch runs ahead, as in real training
            state, metrics = step(state, batch)
        print(backend.__name__, int(step.unreplicate(state).step), float(metrics["loss"].mean()))
    """
)


def test_devices_are_forced_with_a_safe_pool():
    assert jax.device_count() == 8 and jax.default_backend() == "cpu"
    assert int(os.environ["PJRT_NPROC"]) >= 16


def test_calling_again_with_the_same_count_is_a_no_op():
    threads = os.environ["PJRT_NPROC"]
    jdp.force_cpu_devices(8)
    assert jax.device_count() == 8 and os.environ["PJRT_NPROC"] == threads


def test_calling_after_start_with_another_count_is_an_error():
    with pytest.raises(
        RuntimeError,
        match=r"force_cpu_devices\(4\) was called after the JAX backend started .*restart",
    ):
        jdp.force_cpu_devices(4)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_counts(bad, error):
    with pytest.raises(error, match="n must be"):
        jdp.force_cpu_devices(bad)


@pytest.mark.parametrize("run", range(3))
def test_thousands_of_steps_on_8_cpu_devices_never_hang(run):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", LONG_RUN.format(steps=2500)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    assert lines[0:2] == ["pmap", "2500"] and lines[3:5] == ["shard_map", "2500"]
    # Same data, same steps: both backends reach the same loss.
    assert float(lines[2]) == pytest.approx(float(lines[5]), rel=1e-4)


JOB_POOL = textwrap.dedent(
    """
    import os
    from jdp import distributed

    print(distributed._process_count(None, {}), distributed._process_count(3, {}))
    distributed.size_cpu_pool(2 * 4)  # 4 processes x 2 devices
    print(os.environ["PJRT_NPROC"])
    os.environ["PJRT_NPROC"] = "64"
    distributed.size_cpu_pool(8)  # a larger pool already set is kept
    print(os.environ["PJRT_NPROC"])
    """
)


@pytest.mark.parametrize(
    "launcher, expected",
    [
        ({}, "1 3"),  # no launcher: one process (a given count wins)
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}, "4 3"),
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "node1",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "1",
                "SLURM_LOCALID": "1",
            },
            "4 3",
        ),
    ],
)
def test_every_process_gets_the_pool_of_the_whole_jobs_devices(launcher, expected):
    """Each process's CPU pool is sized by the job's devices, before JAX starts (read from
    mpirun's or srun's variables when no count is given), so every process layout rounds
    alike (docs/exact.md, "The CPU thread pool")."""
    names = ("PJRT_NPROC", "NPROC", "OMPI_MCA_orte_hnp_uri", "SLURM_JOB_ID", "SLURM_LOCALID")
    env = {k: v for k, v in os.environ.items() if k not in names} | launcher
    run = subprocess.run(
        [sys.executable, "-c", JOB_POOL], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:3] == [expected, "16", "64"], run.stdout

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

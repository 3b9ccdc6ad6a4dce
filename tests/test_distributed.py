"""Several processes through jdp.launch: same results as one process, and no hangs."""

import collections
import io
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jdp
from jdp import distributed
from jdp import launch as launcher
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent


def launch(processes, devices, script, *args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", str(processes)]
    cmd += [
        "--devices-per-process",
        str(devices),
        str(ROOT / "tests" / "scripts" / script),
        *map(str, args),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_processes_of_two_devices_equal_one_process_of_four(tmp_path, backend):
    results = {}
    for processes, devices in ((2, 2), (1, 4)):
        out = tmp_path / f"{processes}x{devices}"
        run = launch(processes, devices, "multiprocess_train.py", out, backend)
        assert run.returncode == 0, run.stderr[-4000:]
        for i in range(processes):
            assert f"[{i}] done {i} (20, 4)" in run.stdout
        results[processes] = np.load(f"{out}.npz")
    two, one = results[2], results[1]
    for name in ("w1", "b1", "w2"):
        np.testing.assert_allclose(two[name], one[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
    assert one["losses"][-1].mean() < one["losses"][0].mean()


def test_a_failing_process_stops_the_job_quickly(tmp_path):
    start = time.monotonic()
    run = launch(2, 1, "multiprocess_fail.py", tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    assert run.returncode != 0 and elapsed < 30, (run.returncode, elapsed)
    assert "process 1 fails on purpose" in run.stderr
    assert "[launch] process 1 exited with 1; stopping the others" in run.stderr
    for pid_file in tmp_path.glob("*.pid"):
        pid = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_initialize_twice_is_an_error(tmp_path):
    run = launch(1, 1, "multiprocess_twice.py")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "second call: jdp.distributed.initialize() was already called" in run.stdout


def test_initialize_after_the_backend_started_is_an_error():
    jax.devices()  # the backend runs (it may not yet, when this test runs alone)
    with pytest.raises(RuntimeError, match="must come before anything that starts JAX's backend"):
        distributed.initialize("127.0.0.1:1", 2, 0, initialization_timeout=1)


def test_forgetting_initialize_under_the_launcher_is_an_error(monkeypatch):
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(
        RuntimeError,
        match="initialize\\(\\) was not called, but jdp.launch started this process as process 1 of 2",
    ):
        jdp.pmap(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(RuntimeError, match="was not called"):
        jdp.replicate({"w": np.zeros(2)})


def test_launcher_rejects_bad_counts():
    run = subprocess.run(
        [sys.executable, "-m", "jdp.launch", "--processes", "0", "x.py"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "must be >= 1" in run.stderr


def test_a_checkpoint_folder_per_process_is_refused_naming_the_folders(tmp_path):
    """Before, the first save stalled for the whole timeout and then aborted with a stack trace."""
    start = time.monotonic()
    run = launch(2, 1, "multiprocess_own_folders.py", tmp_path, timeout=120)
    assert run.returncode == 3, run.stderr[-3000:]
    for i in (0, 1):
        assert f"process {i}: {tmp_path / str(i)}" in run.stdout, run.stdout[-3000:]
    assert "refused: jdp.Checkpointer: the processes name different folders" in run.stdout
    assert time.monotonic() - start < 60


def test_gloo_lines_are_quiet_also_when_their_pieces_interleave():
    # Pieces as two threads of one process wrote them (seen in a test run).
    lines = (
        "[Gloo] Rank 1 is connected to [Gloo] Rank 11 peer ranks.  is connected to Expected "
        "number of connected peer ranks is : 1\n"
        "1 peer ranks. Expected number of connected peer ranks is : 1\n"
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
        "step 0\n"
    )
    shown, tail = io.StringIO(), collections.deque()
    launcher._pump(io.StringIO(lines), "[1] ", shown, tail, verbose=False)
    assert shown.getvalue() == "[1] step 0\n"
    assert len(tail) == 4  # kept for the failure report
    shown = io.StringIO()
    launcher._pump(io.StringIO(lines), "[1] ", shown, collections.deque(), verbose=True)
    assert shown.getvalue().count("[1] ") == 4


def test_the_failed_step_is_where_a_process_failed_not_where_a_peer_was_stopped():
    # As a busy machine printed it: process 0's loop was a step behind
    # process 1's when the launcher stopped it.
    tails = [
        collections.deque(
            [
                "[jdp] process 0 of 2 on vm received SIGTERM in the training step at step 12: "
                "saving a checkpoint after the step in flight (at most 30 s).\n"
            ]
        ),
        collections.deque(
            [
                "Traceback (most recent call last):\n",
                "RuntimeError: injected failure at step 12\n",
                "[jdp] process 1 of 2 on vm failed in the training step at step 13: "
                "RuntimeError: injected failure at step 12. Ending the job.\n",
            ]
        ),
    ]
    assert launcher._failed_step(tails) == 13
    assert launcher._failed_step(tails[:1]) is None  # stopped, not failed
    because = "[jdp] process 0 of 2 on vm: ending the job because process 1 of 2 on vm failed in "
    tails[1] = collections.deque([because + "the training step at step 13: RuntimeError: x\n"])
    assert launcher._failed_step(tails) == 13

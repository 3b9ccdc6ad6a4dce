"""Kill anywhere, resume anywhere: jdp.launch --max-restarts, and preemption
(SIGTERM) saving a checkpoint that a restart resumes bitwise in exact mode."""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.launching import slurm_up

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "preempt_run.py")
STEPS = 30


def env(**extra):
    base = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    return base | {"PYTHONPATH": str(ROOT), **extra}


def alone(directory, **extra):
    return [sys.executable, SCRIPT, str(directory), str(STEPS)], env(
        JDP_CPU_DEVICES_PER_PROCESS="4", **extra
    )


def launched(directory, processes=2, restarts=0, **extra):
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", str(processes)]
    cmd += ["--devices-per-process", str(4 // processes), "--max-restarts", str(restarts)]
    return [*cmd, SCRIPT, str(directory), str(STEPS)], env(**extra)


def run(cmd_env, timeout=240):
    cmd, environ = cmd_env
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 1 process x 4 devices."""
    directory = tmp_path_factory.mktemp("reference")
    result = run(alone(directory))
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(directory / "final.npz")


def assert_bitwise(directory, reference):
    final = np.load(directory / "final.npz")
    assert final.files == reference.files
    for name in reference.files:
        np.testing.assert_array_equal(final[name], reference[name], err_msg=name)


def test_restarts_after_one_and_two_failures_finish_bitwise(tmp_path, reference):
    one = tmp_path / "one"
    one.mkdir()
    result = run(launched(one, restarts=2, FAIL_AT="1:12"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[launch] restart 1 of 2: the job exited with 1 at step" in result.stderr
    assert "restart 2 of 2" not in result.stderr
    assert_bitwise(one, reference)
    # Two failures, at two steps: the second restart is used too.
    two = tmp_path / "two"
    two.mkdir()
    result = run(launched(two, restarts=2, FAIL_AT="0:8,1:21"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart 1 of 2" in result.stderr and "restart 2 of 2" in result.stderr
    assert_bitwise(two, reference)


def test_a_failure_that_repeats_at_the_same_step_is_not_retried_forever(tmp_path):
    result = run(launched(tmp_path, restarts=2, FAIL_AT="1:12", FAIL_ALWAYS="1"))
    assert result.returncode != 0
    assert "[launch] restart 1 of 2" in result.stderr and "restart 2 of 2" in result.stderr
    assert "restart 3" not in result.stderr
    assert "[launch] giving up after 2 restart(s): the job failed at step" in result.stderr
    assert "every time" in result.stderr, result.stderr[-3000:]


def wait_for_step(proc, step, timeout=120):
    """Reads ``proc``'s stdout until the line ``step N`` (or a later one) appears."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        words = line.split()
        if len(words) >= 2 and words[-2] == "step" and int(words[-1]) >= step:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"step {step} never came")


def test_sigterm_saves_the_last_step_and_the_rerun_finishes_bitwise(tmp_path, reference):
    cmd, environ = alone(tmp_path)
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(proc, 7)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    assert time.monotonic() - sent <= 10
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    printed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    # The last completed step is saved (printed rows lag one step behind): no step is lost.
    assert saved[-1] >= printed[-1] >= 7, (saved, printed[-3:])
    assert f"preempted (SIGTERM); checkpoint {saved[-1]} saved" in err
    again = run(alone(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert_bitwise(tmp_path, reference)


def test_preempted_workers_are_restarted_by_the_launcher(tmp_path, reference):
    cmd, environ = launched(tmp_path, restarts=1)
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(proc, 9)
    for index in range(2):  # the cluster preempts the workers, not the launcher
        os.kill(int((tmp_path / f"pid-{index}").read_text()), signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    assert "preempted (SIGTERM)" in err and "[launch] restart 1 of 1" in err, err[-3000:]
    assert_bitwise(tmp_path, reference)


LAYOUTS = [(1, 4), (2, 2), (4, 1)]


def kill_and_resume(directory, rng, kills):
    """Kills the job ``kills`` times at random (a worker at a random step, or the launcher
    at a random wall time), relaunching on a random layout each time; then runs it to the
    end on a random layout. Returns the layouts and kill points used."""
    history = []
    for _ in range(kills):
        processes, _ = LAYOUTS[rng.integers(len(LAYOUTS))]
        cmd, environ = launched(directory, processes=processes)
        proc = subprocess.Popen(
            cmd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if rng.random() < 0.5:  # a worker, after a random step
            at = int(rng.integers(1, STEPS))
            with contextlib.suppress(AssertionError):  # it finished (or resumed past) first
                wait_for_step(proc, at)
            victim = int(rng.integers(processes))
            pid_file = directory / f"pid-{victim}"
            if proc.poll() is None and pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            history.append((processes, f"worker {victim} at step {at}"))
        else:  # the launcher, from outside, at a random instant
            seconds = float(rng.uniform(2.0, 9.0))
            time.sleep(seconds)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            history.append((processes, f"launcher after {seconds:.1f} s"))
        proc.communicate(timeout=120)
    processes, _ = LAYOUTS[rng.integers(len(LAYOUTS))]
    result = run(launched(directory, processes=processes))
    assert result.returncode == 0, (history, result.stderr[-3000:])
    return history + [(processes, "to the end")]


def test_killed_anywhere_resumed_on_any_layout_is_bitwise(tmp_path, reference):
    # One random schedule per run of the suite; benchmarks/kill_anywhere.py runs many.
    history = kill_and_resume(tmp_path, np.random.default_rng(0), kills=2)
    assert_bitwise(tmp_path, reference), history


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 75)])
def test_stopping_the_launcher_saves_a_last_checkpoint(tmp_path, signum, code):
    """Ctrl-C ends with 130; SIGTERM (a preempted allocation) with 75, the requeue code."""
    cmd, environ = launched(tmp_path)
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(proc, 7)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "preempted (SIGTERM); checkpoint" in err, err[-3000:]
    names = [p.name for p in (tmp_path / "ckpt").iterdir()]
    assert not [n for n in names if "tmp" in n], names  # no half-written checkpoint
    saved = max(int(n) for n in names if n.isdigit())
    printed = [int(line.split()[-1]) for line in out.splitlines() if " step " in line]
    assert saved >= max(printed), (saved, printed[-3:])


def test_a_second_ctrl_c_kills_at_once_without_a_traceback(tmp_path):
    cmd, environ = launched(tmp_path)
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(proc, 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted again: killing every process now" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert time.monotonic() - start < 20, err[-3000:]


@pytest.mark.parametrize("leave", ["sys.exit(3)", "raise RuntimeError('boom')"])
def test_a_leaving_workers_own_children_do_not_outlive_the_job(tmp_path, leave):
    """Process 1 starts a child and leaves (exits, or raises and so exits at once) while
    process 0 trains on: the job ends within the deadline, and the child goes with it."""
    script = tmp_path / "spawn.py"
    script.write_text(
        "import subprocess, sys, pathlib\n"
        "import jdp.distributed\njdp.distributed.initialize()\n"
        "import jax, jax.numpy as jnp, numpy as np, optax, jdp\n"
        "step = jdp.pmap(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))\n"
        "state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))\n"
        "for i in range(1000):\n"
        "    state, m = step(state, step.shard(np.ones(4, np.float32)))\n"
        "    jax.block_until_ready(m)\n"
        "    if jax.process_index() == 1 and i == 3:\n"
        "        child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"        pathlib.Path({str(tmp_path / 'child')!r}).write_text(str(child.pid))\n"
        f"        {leave}\n"
    )
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", "2", "--timeout", "10", str(script)]
    started = time.monotonic()
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stderr[-3000:]
    assert time.monotonic() - started < 60, result.stderr[-3000:]
    named = "process 1: finished after" if "exit" in leave else "process 1 of 2 on"
    assert named in result.stderr, result.stderr[-3000:]
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            stat = pathlib.Path(f"/proc/{child}/stat").read_text()
        except FileNotFoundError:
            return
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.2)
    raise AssertionError("the worker's child outlived the job")


def read_order(log_prefix, processes):
    """``{(process, iterator position): example ids}``; a position read again after a resume
    (prefetching had read ahead of the last checkpoint) keeps its latest reading."""
    order = {}
    for index in range(processes):
        for line in pathlib.Path(f"{log_prefix}-{index}").read_text().splitlines():
            position, ids = line.split(" ", 1)
            order[index, int(position)] = ids
    return order


def test_the_ordinary_step_resumes_the_same_samples_in_the_same_order(tmp_path):
    """Killed and resumed on the same layout: every batch position is trained on the same
    examples as without the kill, none skipped or repeated, and the state agrees."""
    ref_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    result = run(launched(ref_dir, STRATEGY="data_parallel", RECORD=str(ref_dir / "ids")))
    assert result.returncode == 0, result.stderr[-3000:]
    cmd, environ = launched(killed_dir, STRATEGY="data_parallel", RECORD=str(killed_dir / "ids"))
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(proc, 13)
    os.kill(int((killed_dir / "pid-1").read_text()), signal.SIGKILL)
    proc.communicate(timeout=120)
    again = run(launched(killed_dir, STRATEGY="data_parallel", RECORD=str(killed_dir / "ids")))
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_samples_and_close(ref_dir, killed_dir)


def assert_same_samples_and_close(ref_dir, run_dir):
    """Every batch position up to STEPS was trained on the same examples in both runs (their
    $RECORD logs, 2 processes), and the final states agree to rtol 1e-6."""
    expected, got = read_order(ref_dir / "ids", 2), read_order(run_dir / "ids", 2)
    trained = {key: ids for key, ids in expected.items() if key[1] <= STEPS}
    assert {key: got[key] for key in trained} == trained
    reference, final = np.load(ref_dir / "final.npz"), np.load(run_dir / "final.npz")
    for name in reference.files:
        np.testing.assert_allclose(final[name], reference[name], rtol=1e-6, err_msg=name)


def test_an_fsdp_job_restarted_by_the_launcher_ends_as_the_uninterrupted_one(tmp_path):
    """Under fsdp no process holds the whole state: a failure at step 12 restarts the job
    from checkpoint 10, each process restoring its own slices, and the run ends bitwise as
    the same layout's run without the failure."""
    ref_dir, failed_dir = tmp_path / "reference", tmp_path / "failed"
    ref_dir.mkdir(), failed_dir.mkdir()
    result = run(launched(ref_dir, STRATEGY="fsdp"))
    assert result.returncode == 0, result.stderr[-3000:]
    result = run(launched(failed_dir, restarts=1, STRATEGY="fsdp", FAIL_AT="1:12"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[launch] restart 1 of 1: the job exited with 1 at step" in result.stderr
    assert (failed_dir / "failed-1-12").exists()
    # The restart resumed from checkpoint 10 (a run from scratch would end bitwise too).
    printed = [int(line.split()[-1]) for line in result.stdout.splitlines() if "[0] step " in line]
    again = next(i for i in range(1, len(printed)) if printed[i] <= printed[i - 1])
    assert printed[again] == 11, printed
    assert_bitwise(failed_dir, np.load(ref_dir / "final.npz"))


@pytest.mark.skipif(not slurm_up(), reason="no SLURM controller")
def test_sbatch_requeue_resumes_a_preempted_job_bitwise(tmp_path, reference):
    """docs/checkpointing.md's batch script, on CPU: SIGTERM to the job's tasks (as
    --signal or scancel -s TERM send it) -> checkpoint, exit 75 -> scontrol requeue -> the
    requeued job (SLURM starts it about 2 minutes later) resumes and ends bitwise."""
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --requeue --signal=TERM@120 --open-mode=append --output={tmp_path}/out.txt\n"
        f"export PYTHONPATH={ROOT} JDP_CPU_DEVICES_PER_PROCESS=4\n"
        f"srun {sys.executable} {SCRIPT} {tmp_path} {STEPS}\n"
        "code=$?\n"
        'if [ "$code" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi\n'
        'exit "$code"\n'
    )
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    out = tmp_path / "out.txt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "step 7" not in (out.read_text() if out.exists() else ""):
        time.sleep(0.5)
    subprocess.run(["scancel", "-s", "TERM", job_id], check=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (tmp_path / "final.npz").exists():
        time.sleep(1)
    log = out.read_text()
    assert (tmp_path / "final.npz").exists(), log[-3000:]
    assert "Exiting with 75" in log, log[-3000:]
    time.sleep(1)  # final.npz is written before the process exits
    assert_bitwise(tmp_path, reference)

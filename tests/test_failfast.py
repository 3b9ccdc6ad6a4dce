"""Fail fast under every launcher: jdp.launch, Open MPI's mpirun (when
installed; .ci/run installs it), SLURM (its variables, as srun sets them), and no launcher
at all. Each job is 2 processes x 2 CPU devices."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.launching import MPIRUN, MPIRUN_ENV, SRUN, mpirun_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "multiprocess_failfast.py")


LAUNCHERS = ["jdp.launch", MPIRUN, SRUN, "slurm", "jobset"]


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env |= {"PYTHONPATH": str(ROOT), **extra}
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(rank, port, **extra):
    """What srun sets for task ``rank`` of 2 on one node (JAX reads these)."""
    return base_env(
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        JAX_COORDINATOR_PORT=str(port),
        JDP_CPU_DEVICES_PER_PROCESS="2",
        **extra,
    )


def jobset_env(rank, address, **extra):
    return base_env(
        JAX_COORDINATOR_ADDRESS=address,
        JAX_NUM_PROCESSES="2",
        JOB_COMPLETION_INDEX=str(rank),
        JDP_CPU_DEVICES_PER_PROCESS="2",
        **extra,
    )


def start(launcher, mode, out, **extra):
    """Starts the job; returns its processes (each in its own session)."""
    if launcher == "jdp.launch":
        cmd = [sys.executable, "-m", "jdp.launch", "--processes", "2", "--devices-per-process", "2"]
        if "JDP_TIMEOUT" in extra:  # jdp.launch sets it for its processes from --timeout
            cmd += ["--timeout", extra.pop("JDP_TIMEOUT")]
        cmd += [SCRIPT, mode, str(out)]
        envs = [base_env(**extra)]
        cmds = [cmd]
    elif launcher == "mpirun":
        names = ["PYTHONPATH", "JDP_CPU_DEVICES_PER_PROCESS", "JAX_COORDINATOR_PORT", *extra]
        cmds = [mpirun_command(SCRIPT, mode, str(out), exported=names)]
        envs = [
            base_env(
                JDP_CPU_DEVICES_PER_PROCESS="2",
                JAX_COORDINATOR_PORT=str(free_port()),
                **MPIRUN_ENV,
                **extra,
            )
        ]
    elif launcher == "srun":
        cmds = [["srun", "-n", "2", "--label", sys.executable, SCRIPT, mode, str(out)]]
        envs = [base_env(JDP_CPU_DEVICES_PER_PROCESS="2", **extra)]
    elif launcher == "slurm":
        port = free_port()
        cmds = [[sys.executable, SCRIPT, mode, str(out)]] * 2
        envs = [slurm_env(rank, port, **extra) for rank in range(2)]
    elif launcher == "jobset":  # what a Kubernetes Indexed Job / JobSet manifest exports
        address = f"127.0.0.1:{free_port()}"
        cmds = [[sys.executable, SCRIPT, mode, str(out)]] * 2
        envs = [jobset_env(rank, address, **extra) for rank in range(2)]
    else:  # no launcher: one process with 4 devices
        cmds = [[sys.executable, SCRIPT, mode, str(out)]]
        envs = [base_env(JDP_CPU_DEVICES_PER_PROCESS="4", **extra)]
    return [
        subprocess.Popen(
            c,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for c, e in zip(cmds, envs, strict=True)
    ]


def finish(procs, timeout):
    """``(return codes, stderr of all, time the last one ended)``; kills what remains."""
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            err += "\n<killed by the test: still running>"
        outs.append(err)
    return [p.returncode for p in procs], "\n".join(outs), time.time()


def alive(pid, wait=5.0):
    """Still running after ``wait`` seconds (a zombie awaiting its reaper is not)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state == "Z":
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_by_two_trains_like_one_by_four(launcher, tmp_path):
    codes, err, _ = finish(start(launcher, "ok", tmp_path / "two"), 180)
    assert codes == [0] * len(codes), err[-3000:]
    codes, err, _ = finish(start("alone", "ok", tmp_path / "one"), 180)
    assert codes == [0], err[-3000:]
    two, one = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    for name in one.files:  # the psum adds in another order across processes: 1 ulp
        scale = 1e-6 * np.max(np.abs(one[name]))
        np.testing.assert_allclose(two[name], one[name], rtol=1e-6, atol=scale, err_msg=name)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_raising_rank_ends_every_rank_fast_and_is_named(launcher, tmp_path):
    out = tmp_path / "job"
    codes, err, ended = finish(start(launcher, "raise", out), 120)
    failed_at = float((tmp_path / "job-1.failed_at").read_text())
    assert all(code != 0 for code in codes), (codes, err[-3000:])
    assert ended - failed_at <= 15, (ended - failed_at, err[-3000:])
    host = socket.gethostname()
    # The batch of step 3 is read one step ahead (prefetching), while step 2 runs.
    assert f"process 1 of 2 on {host} failed in data loading at step 2" in err, err[-3000:]
    if launcher in ("slurm", "jobset"):  # the healthy rank says why it ends
        assert "process 0 of 2" in err and "ending the job because process 1" in err, err[-3000:]
    for pid_file in tmp_path.glob("job-*.pid"):
        assert not alive(int(pid_file.read_text()))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_an_early_leaving_rank_is_named_within_the_deadline(launcher, tmp_path):
    out = tmp_path / "job"
    codes, err, ended = finish(start(launcher, "short", out, JDP_TIMEOUT="8"), 120)
    left_at = float((tmp_path / "job-1.failed_at").read_text())
    assert all(code != 0 for code in codes), (codes, err[-3000:])
    assert ended - left_at <= 8 + 15, (ended - left_at, err[-3000:])
    assert "process 0 of 2" in err and "made no step call for 8 s" in err, err[-3000:]
    assert "process 1: finished after 3 step calls" in err, err[-3000:]


@pytest.mark.parametrize("launcher", [MPIRUN, SRUN, "slurm", "jobset"])
def test_sigterm_ends_every_rank_cleanly(launcher, tmp_path):
    procs = start(launcher, "sleep", tmp_path / "job")
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("job-*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # inside the loop, in a step or its data
    sent = time.time()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes, err, ended = finish(procs, 60)
    assert all(code != 0 for code in codes), (codes, err[-3000:])
    if launcher in ("slurm", "jobset"):  # each task's own code (mpirun reports its own)
        assert codes == [143, 143], (codes, err[-3000:])
    assert ended - sent <= 15, ended - sent
    if launcher != "srun":  # srun itself, on SIGTERM, kills its tasks (scancel sends TERM first)
        assert "received SIGTERM" in err, err[-3000:]
    for pid_file in tmp_path.glob("job-*.pid"):
        assert not alive(int(pid_file.read_text()))


@pytest.mark.parametrize(
    "drop, expected",
    [
        ("JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES is not"),
        ("JOB_COMPLETION_INDEX", "JAX_PROCESS_ID is not"),
    ],
)
def test_a_coordinator_address_without_count_or_index_is_refused(drop, expected):
    env = jobset_env(0, f"127.0.0.1:{free_port()}")
    del env[drop]
    run = run_python("import jdp.distributed\njdp.distributed.initialize()", env)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: jdp.distributed.initialize: JAX_COORDINATOR_ADDRESS="), last
    assert expected in last and "unset JAX_COORDINATOR_ADDRESS" in last, last


def test_no_launcher_runs_as_one_process(tmp_path):
    codes, err, _ = finish(start("alone", "ok", tmp_path / "one"), 180)
    assert codes == [0], err[-3000:]
    assert (tmp_path / "one.npz").exists()


def run_python(code, env):
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_jdp_launch_inside_a_slurm_allocation_sees_every_device(tmp_path):
    """JAX's SLURM detection would pin each child to the launcher's local rank's GPU."""
    script = tmp_path / "show.py"
    script.write_text(
        "import jdp.distributed\njdp.distributed.initialize()\nimport jax\n"
        "print('visible', jax.process_index(), jax.config.values['jax_cuda_visible_devices'])\n"
    )
    env = slurm_env(0, free_port())
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", "2", str(script)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" all") == 2, run.stdout


def test_jax_options_pass_through_and_timeouts_come_from_timeout():
    code = """
import jax, jdp.distributed as d
seen = {}
d.jax.distributed.initialize = lambda *a, **k: seen.update(k)
d._watchdog.install = lambda *a: None
d.initialize("127.0.0.1:1", 2, 0, cluster_detection_method="mpi4py", timeout=7)
print(seen["cluster_detection_method"], seen["heartbeat_timeout_seconds"], seen["shutdown_timeout_seconds"])
d._CALLED.clear()
try:
    d.initialize("127.0.0.1:1", 2, 0, heartbeat_timeout_seconds=3)
except ValueError as e:
    print("refused:", e)
"""
    run = run_python(code, base_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mpi4py 7 24" in run.stdout, run.stdout
    assert "refused: jdp.distributed.initialize: ['heartbeat_timeout_seconds']" in run.stdout

"""See the job: the process that sets the pace, and the one a hung job waits for, named.

The rules on synthetic timings (exact), then 2-process x 2-device jobs with a
slowed or hung process (tests/scripts/multiprocess_pace.py).
"""

import json
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp import _host_callbacks, _pace, _watchdog
from tests.launching import (
    MPIRUN,
    MPIRUN_ENV,
    SRUN,
    clean_env,
    launch_command,
    mpirun_command,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "multiprocess_pace.py")
STEP = 0.1  # seconds per step in the synthetic timings


def feed(pace, data_per_step, windows, start=0, noise=None, rng=None):
    """Feeds ``windows`` windows of 10 steps; returns the windows after which someone was named."""
    named = []
    totals = pace.totals = getattr(pace, "totals", {})  # each process's data wait and time so far
    for w in range(start, start + windows):
        samples = {}
        for i, extra in enumerate(data_per_step):
            jitter = 0.0 if noise is None else rng.uniform(0, noise * STEP)
            data, total = totals.get(i, (0.0, 0.0))
            totals[i] = (data + 10 * (extra + jitter), total + 10 * STEP)
            samples[i] = [_pace.Sample(10 * (w + 1), *totals[i])]
        if pace.observe(samples) is not None:
            named.append((w, pace.named))
    return named


def test_a_process_ten_percent_slower_is_named_after_three_windows():
    pace = _pace.Pace()
    feed(pace, [0.0, 0.0, 0.0], 1)  # the first samples open the windows
    assert feed(pace, [0.0, 0.0, 0.1 * STEP], 5, start=1) == [(3, 2)]


def test_noise_and_a_slowdown_of_everyone_name_no_one():
    rng = np.random.default_rng(0)
    pace = _pace.Pace()  # 2,000 windows of jitter up to 4% of a step on every process
    assert feed(pace, [0.0, 0.0, 0.0, 0.0], 2000, noise=0.04, rng=rng) == []
    pace = _pace.Pace()  # all four wait 30% of each step for data: no one sets the pace
    assert feed(pace, [0.3 * STEP] * 4, 50) == []


def test_a_slow_process_named_again_only_after_it_recovered():
    pace = _pace.Pace()
    feed(pace, [0.0, 0.0], 1)
    assert feed(pace, [0.0, 0.2 * STEP], 10, start=1) == [(3, 1)]  # named once
    assert feed(pace, [0.0, 0.0], 2, start=11) == []
    assert feed(pace, [0.2 * STEP, 0.0], 3, start=13) == [(15, 0)]


def test_a_rows_pace_is_every_processs_newest_window():
    windows = {
        1: _pace.Window((41, 50), 0.012, 0.1),
        0: _pace.Window((41, 50), 0.002, 0.1),
        2: _pace.Window((31, 40), 0.004, 0.3),
    }
    summary = _pace.summary(windows)
    assert list(summary) == ["data_ms/0", "data_ms/1", "data_ms/2", "spread_ms", "step_ms"]
    expected = [2.0, 12.0, 4.0, 10.0, 100.0]
    np.testing.assert_allclose(list(summary.values()), expected, rtol=1e-12)
    assert _pace.summary({0: windows[0]}) == {"data_ms/0": 2.0, "step_ms": 100.0}  # no spread
    assert _pace.summary({}) == {}
    pace = _pace.Pace()  # observe keeps each process's newest window, named or not
    feed(pace, [0.0, 0.01], 2)
    assert sorted(pace.windows) == [0, 1] and pace.windows[1].steps == (11, 20)


def test_the_report_says_where_the_slow_process_spends_its_time():
    windows = {
        0: _pace.Window((41, 50), 0.002, 0.1, compute=0.030, collective=0.050),
        1: _pace.Window((41, 50), 0.001, 0.1, compute=0.045, collective=0.036),
        2: _pace.Window((41, 50), 0.002, 0.1, compute=0.032, collective=0.049),
    }
    line = _pace.report(1, "process 1 of 3 on h (devices 2, 3)", windows)
    assert line == (
        "process 1 of 3 on h (devices 2, 3) sets the job's pace: it waited 1.0 ms per step for "
        "its data and computed 45.0 ms before the first collective in steps 41-50, its peers "
        "2.0 ms and 31.0 ms, of 100.0 ms per step (3 logged windows in a row): 13% of every "
        "step goes to waiting for it. Look at its device and its step (a slower or throttled "
        "device, work only it does)."
    )
    summary = _pace.summary(windows)
    assert [k for k in summary if k.startswith("compute")] == [f"compute_ms/{i}" for i in range(3)]
    np.testing.assert_allclose(summary["spread_ms"], 1e3 * (0.046 - 0.032), rtol=1e-12)
    np.testing.assert_allclose(summary["collective_ms/1"], 36.0, rtol=1e-12)


def test_compute_on_timed_steps_names_a_process_its_data_waits_do_not():
    pace = _pace.Pace()
    named = []
    for w in range(6):  # 10 steps a window, one timed; process 2 computes 10% of a step longer
        samples = {
            i: [
                _pace.Sample(
                    10 * (w + 1), 0.0, STEP * 10 * (w + 1), (0.05 + 0.01 * (i == 2)) * w, 0.0, w
                )
            ]
            for i in range(3)
        }
        if pace.observe(samples) is not None:
            named.append((w, pace.named))
    assert named == [(3, 2)]  # after 3 windows (the first samples open them)


def test_compute_is_compared_alone_so_a_peers_data_wait_cannot_hide_it():
    # Process 0 waits 4% of a step for its data, process 2 computes 6% longer:
    # their own times (data plus compute) differ by less than 5% of a step.
    pace = _pace.Pace()
    named = []
    for w in range(6):
        samples = {
            i: [
                _pace.Sample(
                    10 * (w + 1),
                    0.04 * STEP * 10 * (w + 1) * (i == 0),
                    STEP * 10 * (w + 1),
                    (0.3 + 0.06 * (i == 2)) * STEP * (w + 1),
                    0.0,
                    w + 1,
                )
            ]
            for i in range(3)
        }
        if pace.observe(samples) is not None:
            named.append((w, pace.named))
    assert named == [(3, 2)]
    window = pace.windows[2]
    peers = statistics.median(pace.windows[i].own for i in (0, 1))
    assert window.own - peers < _pace.SHARE * STEP  # the sum alone would name no one


def test_published_samples_decode_and_rows_of_another_form_are_left_out():
    samples = [_pace.Sample(5, 1.0, 2.0, 0.5, 0.25, 3), _pace.Sample(15, 1.5, 3.0, 0.75, 0.5, 4)]
    assert _pace.decode(_pace.encode(samples)) == samples
    assert _pace.decode('[[5, 1.0, 2.0], [15, 1.5, 3.0, 0.75, 0.5, 4], ["a", 1, 1, 1, 1, 1]]') == [
        samples[1]
    ]
    assert _pace.decode("not json") == [] and _pace.decode('{"5": 1}') == []


def lagging(pace, compute, windows, lag_every=2):
    """Feeds 3 processes' windows (10 steps, one timed, ``compute[i]`` s each); process 2
    publishes one logged step late on every ``lag_every``-th window, as a busy peer does.
    Returns ``[(window, named)]`` and every compared window's steps, by process."""
    named, steps = [], []
    history = {i: [] for i in range(3)}
    for w in range(windows):
        for i in range(3):
            t = 10 * (w + 1)
            history[i].append(_pace.Sample(t, 0.0, STEP * t, compute[i] * (w + 1), 0.0, w + 1))
        late = w % lag_every == 1
        published = {i: h[-_pace.KEEP :] for i, h in history.items()}
        if late:  # its newest sample is not out yet
            published[2] = history[2][-_pace.KEEP - 1 : -1]
        if pace.observe(published) is not None:
            named.append((w, pace.named))
        steps.append({i: win.steps for i, win in pace.windows.items()})
    return named, steps


def test_windows_compared_are_the_same_steps_on_every_process_when_one_publishes_late():
    named, steps = lagging(_pace.Pace(), [0.05, 0.05, 0.05 + 0.1 * STEP], 10)
    assert named and named[0][1] == 2 and named[0][0] <= 6  # late by one window at most
    for compared in steps:  # no window of process 2 spans two logged steps
        assert len(set(compared.values())) <= 1, compared
    # A process one window late names no one when every process computes alike.
    assert lagging(_pace.Pace(), [0.05, 0.05, 0.05], 200)[0] == []


def test_the_report_says_who_and_how_much():
    windows = {0: _pace.Window((41, 50), 0.002, 0.1), 1: _pace.Window((41, 50), 0.012, 0.1)}
    line = _pace.report(1, "process 1 of 2 on h (devices 2, 3)", windows)
    assert line.startswith(
        "process 1 of 2 on h (devices 2, 3) sets the job's pace: it waited 12.0 ms"
    )
    assert "its peers 2.0 ms, of 100.0 ms per step" in line and "10% of every step" in line


@pytest.mark.parametrize(
    "progress, verdict",
    [
        (
            {0: "9 step calls (7 finished), x", 1: "6 step calls (5 finished), y"},
            "the job waits for process(es) [1], behind at 6 step calls",
        ),
        (
            {0: "9 step calls (7 finished), x", 1: "9 step calls (6 finished), y"},
            "the job waits for process(es) [1], behind at 6 finished steps",
        ),
        (
            {0: "9 step calls (7 finished), x", 1: "finished after 9 step calls"},
            "it waits for process(es) [1], which finished or never reported",
        ),
        (
            {0: "9 step calls (7 finished), x"},
            "it waits for process(es) [1], which finished or never reported",
        ),
        (
            {0: "9 step calls (7 finished), x", 1: "9 step calls (7 finished), y"},
            "every process made and finished as many steps (7)",
        ),
    ],
)
def test_a_stall_names_the_process_behind(progress, verdict):
    assert _watchdog._verdict(progress, 2).startswith(verdict)


def launch(
    mode, steps, slowdown=0.0, timeout=20, launcher="jdp.launch", time_every=0, backend="pmap"
):
    """Runs the 2 x 2 job under ``launcher``; ``(return code, stderr, when it ended)``."""
    env = clean_env(PYTHONPATH=str(ROOT))
    args = [SCRIPT, mode, str(steps), str(slowdown), str(time_every), backend]
    if launcher == "jdp.launch":
        cmd = launch_command("--timeout", str(timeout), *args)
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        return run.returncode, run.stderr, time.time()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if launcher == "srun":  # a real SLURM controller (skipped where none answers)
        env |= {"JDP_CPU_DEVICES_PER_PROCESS": "2", "JDP_TIMEOUT": str(timeout)}
        cmd = ["srun", "-n", "2", "--label", sys.executable, *args]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        return run.returncode, run.stderr, time.time()
    if launcher == "mpirun":
        names = ["PYTHONPATH", "JDP_CPU_DEVICES_PER_PROCESS", "JAX_COORDINATOR_PORT", "JDP_TIMEOUT"]
        env |= MPIRUN_ENV | {
            "JDP_CPU_DEVICES_PER_PROCESS": "2",
            "JAX_COORDINATOR_PORT": str(port),
            "JDP_TIMEOUT": str(timeout),
        }
        cmd = mpirun_command(*args, exported=names)
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        return run.returncode, run.stderr, time.time()
    address = f"127.0.0.1:{port}"  # a Kubernetes Indexed Job's variables
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=env
            | {
                "JAX_COORDINATOR_ADDRESS": address,
                "JAX_NUM_PROCESSES": "2",
                "JOB_COMPLETION_INDEX": str(i),
                "JDP_CPU_DEVICES_PER_PROCESS": "2",
                "JDP_TIMEOUT": str(timeout),
            },
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    return max(abs(p.returncode) for p in procs), "\n".join(errs), time.time()


def hung_at(err):
    return float(re.search(r"hanging at ([\d.]+)", err).group(1))


def test_a_process_slowed_ten_percent_in_its_data_is_named_within_50_steps():
    code, err, _ = launch("slow", 90, slowdown=0.1)
    assert code == 0, err[-3000:]
    found = re.search(
        r"process 1 of 2 on (\S+) \(devices [\d, ]+\) sets the job's pace: it "
        r"waited [\d.]+ ms per step for its data in steps \d+-(\d+), .* Look at its data loading",
        err,
    )
    assert found is not None, err[-3000:]
    assert found.group(1) == socket.gethostname() and int(found.group(2)) <= 20 + 50
    # Process 0's rows carry both processes' data waits: the slowed one's is higher.
    pace = json.loads(re.search(r"pace (\{.*\})", err).group(1))
    assert sorted(pace) == ["data_ms/0", "data_ms/1", "spread_ms", "step_ms"], pace
    assert pace["data_ms/1"] - pace["data_ms/0"] >= 0.05 * pace["step_ms"], pace
    # spread_ms is 1e3 * (own1 - own0); the rows are 1e3 * each: equal up to rounding.
    assert pace["spread_ms"] == pytest.approx(pace["data_ms/1"] - pace["data_ms/0"], rel=1e-12)


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_a_process_slowed_ten_percent_in_its_loss_is_named(backend):
    """The sleep is inside the step, so the host's waits cannot see it: the device's stamps do.

    How soon is the benchmark's to say (benchmarks/pace.py, docs/multi-host.md,
    timing every step: within 50 steps in 16/20 jobs on 2 x 4 and 20/20 on
    4 x 2, on a quiet machine). Here it must be named within the run's 150
    steps: one timed step per window is one sample of its compute, and beside
    a busy core the naming came as late as steps 81-90.
    """
    code, err, _ = launch("slow-loss", 150, slowdown=0.1, time_every=10, backend=backend)
    assert code == 0, err[-3000:]
    found = re.search(
        r"process 1 of 2 on \S+ \(devices [\d, ]+\) sets the job's pace: it waited [\d.]+ ms "
        r"per step for its data and computed ([\d.]+) ms before the first collective in steps "
        r"\d+-(\d+), its peers [\d.]+ ms and ([\d.]+) ms, of ([\d.]+) ms per step .* Look at "
        r"its device and its step",
        err,
    )
    assert found is not None, err[-3000:]
    mine, peers, step = (float(found.group(i)) for i in (1, 3, 4))
    assert mine - peers > 0.05 * step  # the rule's share, seen in the device's compute
    pace = json.loads(re.search(r"pace (\{.*\})", err).group(1))
    timed = [f"{k}_ms/{i}" for k in ("collective", "compute") for i in (0, 1)]
    assert sorted(pace) == [*timed, "data_ms/0", "data_ms/1", "spread_ms", "step_ms"], pace
    own = [pace[f"data_ms/{i}"] + pace[f"compute_ms/{i}"] for i in (0, 1)]
    assert pace["spread_ms"] == pytest.approx(max(own) - min(own), rel=1e-12)


def test_a_clean_job_names_no_one():
    code, err, _ = launch("clean", 150)
    assert code == 0, err[-3000:]
    assert "sets the job's pace" not in err, err[-3000:]


@pytest.mark.parametrize("launcher", ["jdp.launch", "jobset", MPIRUN, SRUN])
def test_a_process_hung_in_its_data_is_named_and_ends_the_job(launcher):
    code, err, ended = launch("hang-data", 100, timeout=10, launcher=launcher)
    assert code != 0, err[-3000:]
    assert ended - hung_at(err) <= 10 + 10, err[-3000:]
    assert "made no step call for 10 s" in err, err[-3000:]
    assert "the job waits for process(es) [1], behind at" in err, err[-3000:]
    assert "process 1: 6 step calls" in err and "data loading at step 7" in err, err[-3000:]


@pytest.mark.parametrize("launcher", ["jdp.launch", "jobset", MPIRUN, SRUN])
def test_a_job_hung_inside_a_step_ends_within_the_deadline_and_says_where(launcher):
    code, err, ended = launch("hang-step", 100, timeout=10, launcher=launcher)
    assert code != 0, err[-3000:]
    assert ended - hung_at(err) <= 10 + 10, err[-3000:]
    # Every process made and finished as many steps; the hung callback names process 1.
    assert re.search(
        r"the job waits for process\(es\) \[1\], inside a host callback of the step "
        r"\(process 1: multiprocess_pace\.py:\d+ in <lambda>, now at threading\.py:\d+ in wait for \d+ s\)",
        err,
    ), err[-3000:]
    assert re.search(r"process 0: \d+ step calls \(7 finished\)", err), err[-3000:]


def test_a_stall_names_a_process_inside_a_host_callback():
    waiting = "8 step calls (7 finished), training at step 8"
    held = waiting + "; inside a host callback at run.py:12 in log for 30 s"
    verdict = _watchdog._verdict({0: waiting, 1: held, 2: waiting}, 3)
    assert verdict.startswith(
        "the job waits for process(es) [1], inside a host callback of the step "
        "(process 1: run.py:12 in log for 30 s)"
    ), verdict
    # Without the callback, the same counts say only that every process is inside the step.
    assert "hangs inside one step" in _watchdog._verdict({0: waiting, 1: waiting, 2: waiting}, 3)
    # A process behind in its step calls is named before a callback elsewhere.
    behind = "7 step calls (7 finished), data loading at step 8"
    assert "behind at 7 step calls" in _watchdog._verdict({0: held, 1: behind}, 2)


def test_host_callbacks_running_names_the_callback_and_where_it_waits():
    release, seen = threading.Event(), []

    def look():
        time.sleep(0.5)
        seen.append(_host_callbacks.running())
        release.set()

    threading.Thread(target=look).start()
    jax.jit(lambda x: (jax.debug.callback(lambda _: release.wait(), x), x + 1)[1])(
        jnp.ones(2)
    ).block_until_ready()
    assert re.fullmatch(
        r"test_pace\.py:\d+ in <lambda>, now at threading\.py:\d+ in wait", seen[0]
    ), seen
    assert _host_callbacks.running() is None  # returned


def test_a_stall_whose_peer_finished_says_which_collective_waits_for_ever():
    """A peer that finished while this process waits: a collective only some processes
    reach (jdp.unreplicate of a split state on process 0 only) is the usual cause."""
    waiting = "30 step calls (30 finished), its own code after jdp.fit returned at step 30"
    finished = _watchdog._verdict({0: waiting, 1: "finished after 30 step calls"}, 2)
    assert "jdp.unreplicate of a zero1 or fsdp state" in finished
    assert "call it on every process" in finished
    # A peer that never reported may not have started: no such hint.
    assert "unreplicate" not in _watchdog._verdict({0: waiting}, 2)

"""Start N local processes of a jdp script, for laptops and tests.

    python -m jdp.launch --processes 2 --devices-per-process 4 [--timeout 120] train.py [args]

Each process gets a coordinator on 127.0.0.1 at a free port and the
variables ``jdp.distributed.initialize()`` reads; its output lines are
prefixed with its index. If any process fails, the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher exits with the
failing code, or, with ``--max-restarts K``, starts the whole job again (up to
K times; the script resumes from its checkpoints). A job whose processes stop making progress (one waits in a
collective for a step another never runs) ends within about ``--timeout``
seconds with a message naming them. With ``--elastic``, a restart after
processes were killed runs on those left (down to a divisor of
``--processes``); a script whose checkpointer has a ``local_directory``
resumes from the step the survivors kept (``docs/checkpointing.md``). If the launcher itself is stopped, it
passes SIGTERM on (``jdp.fit`` saves a last checkpoint) and exits with 130 for
Ctrl-C, 75 for SIGTERM or SIGHUP once every process saved ("run me again");
a second Ctrl-C kills at once. If it is killed, so are its processes. Clusters use their own launchers (srun,
mpirun, Kubernetes).
"""

import argparse
import collections
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jdp._watchdog import EXIT_PREEMPTED  # what jdp.fit exits with once it saved on SIGTERM
from jdp.distributed import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TIMEOUT,
    timeout_seconds,
)

GRACE_SECONDS = 5.0
PREEMPTION_GRACE = 35.0  # a little over the processes' own (jdp._watchdog): 30 s
DEFAULT_TIMEOUT = 120
PUMP_SECONDS = 10.0  # waiting for the last lines of processes already gone
# Gloo prints one line per rank and connection; its writes from several
# threads can split and interleave mid-line (seen: "[Gloo] Rank 1 is connected
# to [Gloo] Rank 11 peer ranks. ..."), so any piece of one is noise. Shown
# with --verbose.
NOISE = re.compile(r"\[Gloo\]|peer ranks")
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: the kernel sends SIGKILL when the
    # launcher dies, even by SIGKILL, which no handler of ours can catch.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _pump(stream, prefix: str, sink, tail: collections.deque, verbose: bool) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line)
        if verbose or not NOISE.search(line):
            sink.write(f"{prefix}{line}")
            sink.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to every process group, then SIGKILL after ``grace`` seconds.

    A process that already exited may have left children (data loaders,
    loggers) in its group: every group is signalled, not only live workers'.
    """
    for p in procs:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for p in procs:  # what is left of each group once its leader is gone
        _signal_group(p.pid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _stalled(tails: list[collections.deque], processes: int) -> list[int]:
    """Processes JAX's shutdown barrier names as never arriving.

    JAX prints "Some timed out task names:" followed by one task per line
    ("0", or "/job:jax_worker/replica:0/task:0").
    """
    task = re.compile(r"^\s*(?:\S*task:)?(\d+)\s*$")
    names = set()
    for tail in tails:
        lines = list(tail)
        for i, line in enumerate(lines):
            if "timed out task names" in line:
                for follow in lines[i + 1 :]:
                    match = task.match(follow)
                    if not match:
                        break
                    names.add(int(match.group(1)))
    return sorted(n for n in names if n < processes)


def _start(script, args, processes, devices_per_process, timeout) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(processes):
        env = {
            **os.environ,
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(processes),
            ENV_PROCESS_ID: str(i),
            ENV_CPU_DEVICES: str(devices_per_process),
            ENV_TIMEOUT: str(timeout),
            "PYTHONUNBUFFERED": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: stopping it stops its children
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        )
    return procs


def _watch(procs: list[subprocess.Popen], timeout: float) -> tuple[int, str | None, int]:
    """Waits for the job; returns ``(exit code, why it was stopped or None, processes lost)``.

    Lost: those killed by a signal before the launcher stopped the others.
    """
    finished_at = None
    exited = threading.Event()
    for p in procs:  # a process's exit wakes the loop at once: the others are told in ms
        threading.Thread(target=_set_on_exit, args=(p, exited), daemon=True).start()
    while [p.poll() for p in procs].count(None):  # poll every process, every time
        failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed:
            code = procs[failed[0]].returncode
            lost = sum(1 for p in procs if p.returncode is not None and p.returncode < 0)
            return code, f"process {failed[0]} exited with {code}; stopping the others", lost
        done = [i for i, p in enumerate(procs) if p.returncode == 0]
        if done and finished_at is None:
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > timeout + GRACE_SECONDS:
            running = [i for i, p in enumerate(procs) if p.returncode is None]
            return (
                1,
                f"process(es) {running} still running {timeout:.0f} s after process(es) "
                f"{done} finished: they stopped making progress (waiting in a collective "
                "for a step the others never ran?); stopping them",
                0,
            )
        exited.wait(0.05)
        exited.clear()
    return next((p.returncode for p in procs if p.returncode != 0), 0), None, 0


def _set_on_exit(proc: subprocess.Popen, event: threading.Event) -> None:
    proc.wait()
    event.set()


def launch(
    script: str,
    args: list[str],
    processes: int,
    devices_per_process: int,
    *,
    timeout: int = DEFAULT_TIMEOUT,
    verbose: bool = False,
    max_restarts: int = 0,
    elastic: bool = False,
) -> int:
    """Runs ``script`` in ``processes`` processes; returns the job's exit code.

    With ``max_restarts``, a job that fails is stopped and started again, all
    processes together, up to that many times (torchrun's rule); the script
    resumes from its checkpoints. Giving up, it says whether every failure was
    at the same step (a failure that restarts cannot get past). With
    ``elastic``, a restart after processes were killed (by a signal: a lost
    machine, the OOM killer) runs on the processes left, lowered to the
    largest count that divides ``processes`` (so exact mode's virtual
    replicas still divide evenly among the devices).
    """
    steps: list[int | None] = []
    running = processes
    for attempt in range(max_restarts + 1):
        code, why, tails, interrupted, lost = _run(
            script, args, running, devices_per_process, timeout, verbose
        )
        if why:
            sys.stderr.write(f"[launch] {why}\n")
        if code == 0 or interrupted:  # done, or the launcher itself was stopped
            break
        steps.append(_failed_step(tails))
        at = "" if steps[-1] is None else f" at step {steps[-1]}"
        if attempt == max_restarts:
            if max_restarts:
                same = len(set(steps)) == 1 and steps[0] is not None
                sys.stderr.write(
                    f"[launch] giving up after {max_restarts} restart(s): the job failed "
                    + (f"at step {steps[0]} every time" if same else f"again{at}")
                    + ".\n"
                )
            break
        left = _left(processes, running, lost) if elastic else running
        on = "" if left == running else f", on the {left} process(es) left of {running}"
        sys.stderr.write(
            f"[launch] restart {attempt + 1} of {max_restarts}: the job exited with "
            f"{code}{at}{on}\n"
        )
        sys.stderr.flush()
        running = left
    return 1 if code < 0 else code


def _left(processes: int, running: int, lost: int) -> int:
    """The processes a restart runs on: those left, down to a divisor of ``processes``."""
    left = max(running - lost, 1)
    return max(d for d in range(1, left + 1) if processes % d == 0)


def _failed_step(tails: list[collections.deque]) -> int | None:
    """The step a process reported failing at ("[jdp] process ... at step N").

    A process that reports receiving SIGTERM was stopped by the launcher
    after the failure: where it was then is not where the job failed (a
    peer whose loop ran a step behind said one step earlier).
    """
    found = [
        int(m.group(1))
        for tail in tails
        for line in tail
        if (m := _FAILED_AT.search(line)) is not None and "received SIGTERM" not in line
    ]
    return min(found) if found else None


_FAILED_AT = re.compile(r"\[jdp\] process \d+ of \d+ .*? at step (\d+)")


def _run(script, args, processes, devices_per_process, timeout, verbose):
    """One run of the job: ``(exit code, why it was stopped or None, output tails)``."""
    procs = _start(script, args, processes, devices_per_process, timeout)
    tails = [collections.deque(maxlen=200) for _ in procs]
    pumps = []
    for i, p in enumerate(procs):
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(
                target=_pump, args=(stream, f"[{i}] ", sink, tails[i], verbose), daemon=True
            )
            t.start()
            pumps.append(t)

    signals: list[int] = []

    def terminate(signum, frame):
        signals.append(signum)
        raise KeyboardInterrupt

    def kill_now(signum, frame):  # a second Ctrl-C or SIGTERM: stop waiting for the saves
        sys.stderr.write("[launch] interrupted again: killing every process now\n")
        for p in procs:
            _signal_group(p.pid, signal.SIGKILL)

    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, terminate) for s in stopping}
    grace = GRACE_SECONDS
    lost = 0
    try:
        code, why, lost = _watch(procs, timeout)
    except KeyboardInterrupt:
        # Interrupted (Ctrl-C, SIGTERM): jdp.fit saves a last checkpoint on the
        # SIGTERM it now receives, which may take a few steps; wait for it.
        for s in stopping:
            signal.signal(s, kill_now)
        if not signals:  # a KeyboardInterrupt from elsewhere
            signals.append(signal.SIGINT)
        code, why, grace = 0, "interrupted; stopping every process", PREEMPTION_GRACE
    finally:
        _stop(procs, grace)
        # Every process is gone: the pipes end soon, but not at once on a busy machine.
        for t in pumps:
            t.join(timeout=PUMP_SECONDS)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals:
        code = _interrupted_code(signals[0], procs)
    stalled = _stalled(tails, processes)
    if stalled:
        why = (
            f"process(es) {stalled} stopped making progress: the others waited for them at "
            f"exit for {timeout} s (do all processes run the same number of steps?)"
        )
    return code, why, tails, bool(signals), lost


def _interrupted_code(signum: int, procs: list[subprocess.Popen]) -> int:
    """Ctrl-C: 130. SIGTERM or SIGHUP (preemption): 75 when every process saved and
    asks to be run again (``jdp.fit``'s exit code), else 128 + the signal, as shells say."""
    if signum != signal.SIGINT and all(p.returncode == EXIT_PREEMPTED for p in procs):
        return EXIT_PREEMPTED
    return 128 + signum


def _timeout(flag: float | None) -> int:
    """``--timeout``, else the ``$JDP_TIMEOUT`` the user exported, else the default."""
    if flag is not None:
        return timeout_seconds(flag, "--timeout", "jdp.launch")
    if ENV_TIMEOUT in os.environ:
        return timeout_seconds(os.environ[ENV_TIMEOUT], f"${ENV_TIMEOUT}", "jdp.launch")
    return DEFAULT_TIMEOUT


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m jdp.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--processes", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process", type=int, default=1, help="CPU devices forced in each process"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before a job whose processes stopped making progress is ended "
        f"(JAX heartbeats and shutdown barrier; default ${ENV_TIMEOUT} if exported, "
        f"else {DEFAULT_TIMEOUT})",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job this many times after a failure (default 0); the "
        "script resumes from its checkpoints",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="restart on the processes left after some were killed by a signal (down to a "
        "divisor of --processes), not on as many as before",
    )
    parser.add_argument("--verbose", action="store_true", help="show Gloo's connection lines")
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.processes < 1 or ns.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    try:
        timeout = _timeout(ns.timeout)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if ns.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if not os.path.isfile(ns.script):
        # Every process would fail alone with Python's message, and a restart would repeat it.
        parser.error(f"script {ns.script!r} is not a file: pass the path of the script to run")
    code = launch(
        ns.script,
        ns.args,
        ns.processes,
        ns.devices_per_process,
        timeout=timeout,
        verbose=ns.verbose,
        max_restarts=ns.max_restarts,
        elastic=ns.elastic,
    )
    sys.exit(code)


if __name__ == "__main__":
    main()

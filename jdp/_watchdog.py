"""Fail fast in a multi-process job, under any launcher.

A job of several processes hangs when one of them raises, dies or leaves the
loop early: the others wait in a collective, and JAX's shutdown barrier waits
(300 s by default) for the one that left. Whatever started the processes
(``jdp.launch``, ``srun``, ``mpirun``, Kubernetes), :func:`install` makes each
process of a multi-process job

- report an uncaught exception with its process index, host and what it was
  doing (:func:`set_phase`), publish that in JAX's key-value store, finish in-flight
  checkpoint saves (bounded) and exit at once, so the collectives of the
  others fail and they exit too, naming the process that failed;
- end on SIGTERM (cancellation, preemption) within seconds, even while the main
  thread waits in a collective;
- run a watchdog thread: when this process made no step call for ``deadline``
  seconds, it names the processes that finished or fell behind (read from the
  key-value store) and exits.

Nothing here changes what a step computes; it only decides when to stop.
"""

import atexit
import collections
import contextlib
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jdp import _host_callbacks, _jax_private
from jdp._pace import KEEP, Pace, Sample, decode, encode, report, summary

DEFAULT_DEADLINE = 600.0  # seconds without a step call; compiles longer than this need more
EXIT_FAILED, EXIT_TERMINATED, EXIT_PREEMPTED = 1, 143, 75  # 75: EX_TEMPFAIL, "run me again"
PREEMPTION_GRACE = 30.0  # seconds from SIGTERM to a saved checkpoint (SLURM's KillWait default)
PREEMPTION_CHECK_EVERY = 4  # steps between the processes' agreements on a preemption
_PREFIX = "jdp/"


class _Job:
    """This process's view of the job (one instance, set by :func:`install`)."""

    def __init__(self, state: Any, deadline: float, before_exit: Callable[[float], None]):
        self.client, self.deadline, self.before_exit = state.client, deadline, before_exit
        several = state.client is not None and (state.num_processes or 1) > 1
        self.index: int = state.process_id if several else 0
        self.count: int = state.num_processes if several else 1
        self.host = socket.gethostname()
        self.phase: str | None = None  # None: a loop of the user's own (not jdp.fit)
        self.step: int | None = None
        self.calls, self.last_call = 0, time.monotonic()
        self.finished = False
        self.stopped = threading.Event()
        self.watcher: threading.Thread | None = None
        self.savers = 0  # jdp.fit loops that save a checkpoint on preemption
        self.preempted_at: float | None = None
        self.pace = Pace()  # process 0: who is slower than its peers (jdp._pace)
        self.samples: collections.deque[Sample] = collections.deque(maxlen=KEEP)  # published
        self.results: queue.SimpleQueue | None = queue.SimpleQueue() if self.count > 1 else None
        self.finished_steps = 0  # step calls whose results the device finished
        self.callback: tuple[str, float] | None = None  # where a host callback runs, since when

    def who(self) -> str:
        return f"process {self.index} of {self.count} on {self.host}"

    def status(self) -> str:
        """What this process publishes as its progress (asked by the watchdog thread)."""
        where = _host_callbacks.running()
        if where is None:
            self.callback = None
        elif self.callback is None or self.callback[0] != where:
            self.callback = (where, time.monotonic())
        inside = ""
        if self.callback is not None:
            seconds = time.monotonic() - self.callback[1]
            inside = f"; inside a host callback at {self.callback[0]} for {seconds:.0f} s"
        return f"{self.calls} step calls ({self.finished_steps} finished), {self.doing()}{inside}"

    def doing(self) -> str:
        if self.phase is None:
            return f"its own loop, after {self.calls} step calls"
        return self.phase + ("" if self.step is None else f" at step {self.step}")

    def publish(self, key: str, value: str) -> None:
        if self.client is None:
            return
        with contextlib.suppress(Exception):  # the coordinator may be gone already
            self.client.key_value_set(_PREFIX + key, value, allow_overwrite=True)

    def read(self, key: str) -> str | None:
        if self.client is None:
            return None
        try:
            return self.client.key_value_try_get(_PREFIX + key)
        except Exception:
            return None

    def entries(self, folder: str) -> dict[int, str]:
        """Each process's value under ``folder`` (``progress/``, ``time/``), by process index."""
        try:
            entries = self.client.key_value_dir_get(_PREFIX + folder)
        except Exception:
            return {}
        return {int(key.rsplit("/", 1)[-1]): value for key, value in entries}

    def exit(self, code: int, message: str, timeout: float = 10.0) -> None:
        sys.stderr.write(f"[jdp] {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        self.before_exit(timeout)
        os._exit(code)


# The job this process belongs to, once jdp.distributed.initialize installed it.
JOB: _Job | None = None


def install(deadline: float | None, before_exit: Callable[[float], None]) -> None:
    """Installs the exception hook, the SIGTERM handler and (several processes) the watchdog.

    In one process the exception hook only finishes in-flight checkpoint saves.
    """
    global JOB
    state = _jax_private.coordination_state()
    JOB = _Job(state, deadline or DEFAULT_DEADLINE, before_exit)
    _on_sigterm(JOB)
    if JOB.count < 2:
        sys.excepthook = _finishing(before_exit)
        return
    sys.excepthook = _on_exception
    JOB.publish(f"host/{JOB.index}", JOB.host)
    counter = threading.Thread(
        target=_count_finished, args=(JOB, JOB.results), name="jdp-finished", daemon=True
    )
    counter.start()
    JOB.watcher = threading.Thread(target=_watch, args=(JOB,), name="jdp-watchdog", daemon=True)
    JOB.watcher.start()
    # Registered after JAX's own shutdown hook, so it runs first: a process that
    # finished says so before it waits in JAX's shutdown barrier.
    atexit.register(_finish)


def counts_results() -> bool:
    """Whether :func:`note_result` wants step results (several processes only).

    Asked before a step's outputs are inspected, so a single process pays
    nothing per call for the count.
    """
    job = JOB
    return job is not None and job.results is not None


def note_result(result: Any) -> None:
    """A step call's result (a few small arrays): a thread counts when the device finishes it.

    Several processes only. Waiting happens in that thread, so dispatch never
    waits; the count tells a process whose device is behind from its peers.
    """
    job = JOB
    if job is not None and job.results is not None:
        job.results.put(result)


def _count_finished(job: "_Job", results: queue.SimpleQueue) -> None:
    import jax

    while True:
        result = results.get()
        with contextlib.suppress(Exception):  # a failed step is the main thread's to report
            jax.block_until_ready(result)
        job.finished_steps += 1


def note_step() -> None:
    """A step call: progress, for the watchdog (cheap; a no-op in one process)."""
    job = JOB
    if job is not None:
        job.calls += 1
        job.last_call = time.monotonic()


def processes() -> int:
    """How many processes the job has (1 before :func:`install`)."""
    return 1 if JOB is None else JOB.count


def note_time(
    step: int, seconds: dict[str, float], device: tuple[float, float, int] | None = None
) -> dict[str, float]:
    """This process's ledger at a logged step (``jdp.fit``): published; process 0 compares.

    ``device``: seconds computing and in the first collective over this
    process's timed steps so far, and how many (:mod:`jdp._stamps`). One
    key-value write per logged step (process 0 also reads every
    process's), no collective: the device never waits for it. Returns, on
    process 0 of several, each process's newest window
    (:func:`jdp._pace.summary`) for the row; else an empty dict.
    """
    job = JOB
    if job is None or job.count < 2:
        return {}
    job.samples.append(Sample(step, seconds["data"], sum(seconds.values()), *(device or ())))
    job.publish(f"time/{job.index}", encode(job.samples))
    if job.index != 0:
        return {}
    named = job.pace.observe({i: decode(text) for i, text in job.entries("time/").items()})
    if named is not None:
        index, windows = named
        sys.stderr.write(f"[jdp] {report(index, _describe(index, job), windows)}\n")
        sys.stderr.flush()
    return summary(job.pace.windows)


def _describe(index: int, job: "_Job") -> str:
    """``process i of n on host (devices ...)``, the host as the process published it."""
    import jax

    devices = [d.id for d in jax.devices() if d.process_index == index]
    host = job.read(f"host/{index}") or "its host"
    return f"process {index} of {job.count} on {host} (devices {', '.join(map(str, devices))})"


def set_phase(name: str, step: int | None = None) -> None:
    """Records what this process is doing now, named in failure messages.

    Kept until the next call: the last phase entered is what the process was
    doing, also when an exception leaves it.
    """
    job = JOB
    if job is not None:
        job.phase, job.step = name, step


@contextlib.contextmanager
def preemptible() -> Iterator[None]:
    """While inside, SIGTERM asks the loop to save and exit (:func:`preemption_agreed`)."""
    job = JOB
    if job is None:
        yield
        return
    job.savers += 1
    try:
        yield
    finally:
        job.savers -= 1


def preemption_agreed(step: int) -> bool:
    """Whether the loop should save and exit after ``step``, the same on every process.

    One process: as soon as SIGTERM arrived. Several: every
    ``PREEMPTION_CHECK_EVERY`` steps the processes exchange whether any of
    them received it (one tiny collective), so all stop at the same step.
    """
    job = JOB
    if job is None or job.savers == 0:
        return False
    if job.count < 2:
        return job.preempted_at is not None
    if step % PREEMPTION_CHECK_EVERY:
        return False
    from jax.experimental import multihost_utils

    flag = np.asarray(job.preempted_at is not None, np.int32)
    return bool(np.any(multihost_utils.process_allgather(flag)))


def exit_preempted(step: int, where: str) -> None:
    """Ends the process after the preemption checkpoint, with "run me again"."""
    job = JOB
    if job is None:  # pragma: no cover - only called after preemption_agreed
        return
    job.exit(
        EXIT_PREEMPTED,
        f"{job.who()}: preempted (SIGTERM); checkpoint {step} saved in {where}. Exiting with "
        f"{EXIT_PREEMPTED} (run me again: jdp.launch --max-restarts, SLURM --requeue).",
    )


def end_job(message: str) -> None:
    """Ends this process, and so the job, through the fail-fast path, naming why.

    The other processes' next collective fails and they exit too, naming this
    one; in-flight checkpoint saves finish first (bounded). Exit status 1, so
    ``jdp.launch --max-restarts`` or the scheduler restarts the job.
    """
    job = JOB
    if job is None:  # no jdp.distributed.initialize: one process, nothing to tell
        sys.stderr.write(f"[jdp] {message}\n")
        sys.stderr.flush()
        os._exit(EXIT_FAILED)
    report = f"{job.who()} ended the job in {job.doing()}: {message}"
    job.publish("failed", report)
    job.exit(EXIT_FAILED, report)


def _finishing(before_exit: Callable[[float], None]) -> Callable[..., None]:
    """One process: an uncaught exception still finishes in-flight checkpoint saves."""

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        sys.__excepthook__(exc_type, exc, tb)
        before_exit(60.0)

    return hook


def _on_exception(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    sys.__excepthook__(exc_type, exc, tb)
    job = JOB
    if job is None:  # pragma: no cover - installed only with a job
        os._exit(EXIT_FAILED)
    other = job.read("failed")
    if other is not None and not other.startswith(job.who()):
        job.exit(EXIT_FAILED, f"{job.who()}: ending the job because {other}")
    report = f"{job.who()} failed in {job.doing()}: {exc_type.__name__}: {exc}"
    job.publish("failed", report)
    job.exit(EXIT_FAILED, report + ". Ending the job.")


def _on_sigterm(job: _Job) -> None:
    """Handles SIGTERM in a thread: the main thread may be blocked in a collective.

    The C-level handler Python installs writes the signal to a wakeup file
    descriptor; a daemon thread reads it and ends the process.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.set_wakeup_fd(write_fd)

    def wait() -> None:
        while signal.SIGTERM not in os.read(read_fd, 64):
            pass
        if job.savers:  # jdp.fit saves a checkpoint at the next agreed step, then exits
            # What must not wait first (the survivors' copy): a peer may be gone
            # already, and then the agreed step never comes.
            job.before_exit(0.0)
            job.preempted_at = time.monotonic()
            sys.stderr.write(
                f"[jdp] {job.who()} received SIGTERM in {job.doing()}: saving a checkpoint "
                f"after the step in flight (at most {PREEMPTION_GRACE:.0f} s).\n"
            )
            sys.stderr.flush()
            time.sleep(PREEMPTION_GRACE)
            job.exit(EXIT_TERMINATED, f"{job.who()}: no checkpoint within the grace period.")
        job.exit(
            EXIT_TERMINATED,
            f"{job.who()} received SIGTERM in {job.doing()}; "
            "finished pending checkpoint saves and exited.",
        )

    threading.Thread(target=wait, name="jdp-sigterm", daemon=True).start()


def _watch(job: _Job) -> None:
    """Publishes progress, follows another process's failure, detects a stall.

    It stops when this process finishes (:func:`_finish`, at exit): JAX then
    shuts its coordination client down, and a call through it from this thread
    would abort the process (measured: "FATAL: exception not rethrown").
    """
    period = min(2.0, job.deadline / 4)
    while not job.stopped.wait(period):
        job.publish(f"progress/{job.index}", job.status())
        failed = job.read("failed")
        if failed is not None and not failed.startswith(job.who()):
            job.exit(EXIT_FAILED, f"{job.who()}: ending the job because {failed}")
        if job.calls and time.monotonic() - job.last_call > job.deadline:
            _stalled(job)


def _stalled(job: _Job) -> None:
    progress = job.entries("progress/")
    progress[job.index] = job.status()
    lines = [f"process {i}: {progress.get(i, 'never reported')}" for i in range(job.count)]
    report = (
        f"{job.who()} made no step call for {job.deadline:.0f} s "
        f"(in {job.doing()}): {_verdict(progress, job.count)}. " + "; ".join(lines)
    )
    job.publish("failed", report)
    job.exit(EXIT_FAILED, report + ". Ending the job (deadline: JDP_TIMEOUT or timeout=).")


def _verdict(progress: dict[int, str], count: int) -> str:
    """Who the job waits for, from each process's published step calls and finished steps."""
    counts = {i: _counts(progress.get(i)) for i in range(count)}
    running = {i: c for i, c in counts.items() if c is not None}
    if len(running) < count:
        done = sorted(set(range(count)) - set(running))
        verdict = f"it waits for process(es) {done}, which finished or never reported"
        if any(progress.get(i, "").startswith("finished") for i in done):
            verdict += (
                " (a collective that only some processes reach waits for ever: "
                "jdp.unreplicate of a zero1 or fsdp state, whose slices live on every process, "
                "inside `if jax.process_index() == 0:`, say; call it on every process)"
            )
        return verdict
    for k, what in ((0, "step calls"), (1, "finished steps")):
        fewest = min(c[k] for c in running.values())
        behind = sorted(i for i, c in running.items() if c[k] == fewest)
        if len(behind) < count:
            return f"the job waits for process(es) {behind}, behind at {fewest} {what}"
    inside = {i: m.group(1) for i, e in progress.items() if (m := _INSIDE.search(e))}
    if inside:
        held = sorted(inside)
        return (
            f"the job waits for process(es) {held}, inside a host callback of the step "
            f"({'; '.join(f'process {i}: {inside[i]}' for i in held)}), so the others "
            "wait in the step's collectives; a jax.debug.callback, pure_callback or "
            "io_callback that does not return holds every process"
        )
    return (
        f"every process made and finished as many steps ({fewest}), so the job hangs inside "
        "one step on every process (a collective that some process's device never reached)"
    )


def _counts(entry: str | None) -> tuple[int, int] | None:
    """``(calls, finished)`` of a running process's published status (None: finished, unknown)."""
    match = None if entry is None else _STATUS.match(entry)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


_STATUS = re.compile(r"(\d+) step calls \((\d+) finished\)")
_INSIDE = re.compile(r"; inside a host callback at (.+ for \d+ s)$")


def _finish() -> None:
    job = JOB
    if job is None or job.finished:
        return
    job.finished = True
    job.stopped.set()
    if job.watcher is not None:
        job.watcher.join(timeout=10)  # no call of its in flight when JAX shuts down
    job.publish(f"progress/{job.index}", f"finished after {job.calls} step calls")

"""Several processes: a thin layer over ``jax.distributed``.

Each process calls :func:`initialize` first thing. With no arguments it reads
the variables ``python -m jdp.launch`` sets, or else lets JAX detect the
cluster (SLURM, TPU pods, Kubernetes and the other environments JAX
supports); explicit arguments go straight to ``jax.distributed.initialize``.
"""

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import multihost_utils

from jdp._devices import force_cpu_devices
from jdp._tree import PyTree, is_prng_key

ENV_COORDINATOR = "JDP_COORDINATOR"
ENV_NUM_PROCESSES = "JDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDP_PROCESS_ID"
ENV_CPU_DEVICES = "JDP_CPU_DEVICES_PER_PROCESS"
ENV_TIMEOUT = "JDP_TIMEOUT"

# Work to finish before a failed process exits at once (e.g. in-flight
# checkpoint saves); modules above this one register theirs.
_BEFORE_FATAL_EXIT: list[Callable[[float], None]] = []


def before_fatal_exit(fn: Callable[[float], None]) -> None:
    """Registers ``fn(timeout_s)`` to run when an uncaught exception ends this process."""
    if fn not in _BEFORE_FATAL_EXIT:
        _BEFORE_FATAL_EXIT.append(fn)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cpu_devices_per_process: int | None = None,
    initialization_timeout: int = 300,
    timeout: int | None = None,
) -> None:
    """Joins this process to a multi-process job on JAX's distributed runtime.

    Call it once, before any other JAX or jdp call that touches devices.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator. Default:
        ``$JDP_COORDINATOR`` (set by ``jdp.launch``), else JAX's cluster
        auto-detection.
      num_processes: the number of processes (default as above).
      process_id: this process's index (default as above).
      local_device_ids: restrict this process to these local devices (GPUs).
      cpu_devices_per_process: force this many CPU devices in each process
        (``jdp.force_cpu_devices``), default ``$JDP_CPU_DEVICES_PER_PROCESS``;
        CPU collectives between processes use gloo.
      initialization_timeout: seconds to wait for every process to join.
      timeout: seconds after which a process that stopped answering (missed
        heartbeats) or a process waiting at exit for the others (JAX's
        shutdown barrier) ends the job with an error naming the missing
        processes, instead of waiting forever. Default ``$JDP_TIMEOUT`` (set
        by ``jdp.launch --timeout``), else JAX's defaults (100 s heartbeats,
        300 s shutdown).

    Raises:
      RuntimeError: called twice, or after JAX's backend already started (a
        collective, an array or ``jax.devices()`` came first).
    """
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jdp.distributed.initialize() was already called in this process; call it once."
        )
    if _backend_started():
        raise RuntimeError(
            "jdp.distributed.initialize() must come before anything that starts "
            "JAX's backend (creating an array, jax.devices(), a jdp step). Move it "
            "to the top of the script."
        )
    env = os.environ
    if ENV_COORDINATOR in env:
        sys.excepthook = _exit_at_once
    if coordinator_address is None and ENV_COORDINATOR in env:
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = int(env[ENV_NUM_PROCESSES]) if num_processes is None else num_processes
        process_id = int(env[ENV_PROCESS_ID]) if process_id is None else process_id
    if cpu_devices_per_process is None and ENV_CPU_DEVICES in env:
        cpu_devices_per_process = int(env[ENV_CPU_DEVICES])
    if cpu_devices_per_process:
        force_cpu_devices(cpu_devices_per_process)
    if timeout is None and ENV_TIMEOUT in env:
        timeout = int(env[ENV_TIMEOUT])
    timeouts: dict[str, Any] = {}
    if timeout is not None:
        timeouts = {"heartbeat_timeout_seconds": timeout, "shutdown_timeout_seconds": timeout}
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        **timeouts,
    )


def _exit_at_once(exc_type, exc, tb) -> None:
    """Under jdp.launch: report an uncaught exception and exit now.

    A normal exit runs JAX's distributed shutdown, which waits for the other
    processes, and they may be waiting in a collective for this one: the job
    would hang until a timeout. Exiting at once lets the launcher see the
    failure and stop the others within seconds. ``os._exit`` skips atexit,
    so an in-flight asynchronous checkpoint is finished first (bounded wait).
    """
    sys.__excepthook__(exc_type, exc, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    for finish in _BEFORE_FATAL_EXIT:
        finish(float(os.environ.get(ENV_TIMEOUT, 60)))
    os._exit(1)


def _backend_started() -> bool:
    # JAX has no public query for this; called too late, its own
    # initialize can abort the process instead of raising.
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def check_initialized() -> None:
    """Raises if ``jdp.launch`` started this process but it never joined the job.

    Without it, every process would silently train alone on its slice.
    """
    if ENV_COORDINATOR in os.environ and not jax.distributed.is_initialized():
        raise RuntimeError(
            f"This process was started by jdp.launch as process "
            f"{os.environ.get(ENV_PROCESS_ID)} of {os.environ.get(ENV_NUM_PROCESSES)}, but "
            "jdp.distributed.initialize() was not called. Call it first thing in the script."
        )


def is_multiprocess() -> bool:
    """True when this process is one of several."""
    return jax.process_count() > 1


def from_process0(tree: PyTree) -> PyTree:
    """Process 0's values on every process (a collective when there are several).

    The multi-process parameter sync of Caffe2's MPI broadcast; a no-op in a
    single process.
    """
    check_initialized()
    if jax.process_count() == 1:
        return tree
    data = jax.tree.map(lambda x: jax.random.key_data(x) if is_prng_key(x) else x, tree)
    data = multihost_utils.broadcast_one_to_all(data)
    return jax.tree.map(
        lambda x, d: (
            jax.random.wrap_key_data(d, impl=jax.random.key_impl(x)) if is_prng_key(x) else d
        ),
        tree,
        data,
    )

"""Several processes: a thin layer over ``jax.distributed``.

Each process calls :func:`initialize` first thing. With no arguments it reads
the variables ``python -m jdp.launch`` sets, or else lets JAX detect the
cluster (SLURM, TPU pods, Kubernetes and the other environments JAX
supports); explicit arguments go straight to ``jax.distributed.initialize``.
"""

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.experimental import multihost_utils

from jdp import _jax_private, _watchdog
from jdp._args import check_int
from jdp._devices import force_cpu_devices, size_cpu_pool
from jdp._tree import PyTree, is_prng_key

ENV_COORDINATOR = "JDP_COORDINATOR"
ENV_NUM_PROCESSES = "JDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDP_PROCESS_ID"
ENV_CPU_DEVICES = "JDP_CPU_DEVICES_PER_PROCESS"
ENV_TIMEOUT = "JDP_TIMEOUT"
# A job's own exports (a Kubernetes Indexed Job or JobSet manifest, a custom
# launcher). JAX reads only the address; the count and index complete it.
ENV_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_JAX_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_JAX_PROCESS_ID = "JAX_PROCESS_ID"
ENV_JOB_INDEX = "JOB_COMPLETION_INDEX"  # Kubernetes sets it in every pod of an Indexed Job

# Work to finish before a failed process exits at once (e.g. in-flight
# checkpoint saves); modules above this one register theirs.
_BEFORE_FATAL_EXIT: list[Callable[[float], None]] = []


def before_fatal_exit(fn: Callable[[float], None], *, first: bool = False) -> None:
    """Registers ``fn(timeout_s)`` to run when a failure or SIGTERM ends this process.

    ``first``: before the others (what must not wait behind a bounded wait).
    """
    if fn not in _BEFORE_FATAL_EXIT:
        _BEFORE_FATAL_EXIT.insert(0 if first else len(_BEFORE_FATAL_EXIT), fn)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cpu_devices_per_process: int | None = None,
    initialization_timeout: int = 300,
    timeout: float | None = None,
    **jax_kwargs: Any,
) -> None:
    """Joins this process to a multi-process job on JAX's distributed runtime.

    Call it once, before any other JAX or jdp call that touches devices. With
    no arguments it reads, in order: the variables ``python -m jdp.launch``
    sets; the cluster JAX detects (SLURM ``srun``/``sbatch``, Open MPI
    ``mpirun``, Kubernetes through its API, Cloud TPU; MPICH and others
    through ``cluster_detection_method="mpi4py"``); ``JAX_COORDINATOR_ADDRESS``
    with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (or Kubernetes'
    ``JOB_COMPLETION_INDEX``), as a JobSet or Indexed Job manifest exports
    them; with none of these, it runs as one process (a plain
    ``python train.py``).

    In a job of several processes it also makes the job fail fast: an
    uncaught exception in any process ends every process within seconds,
    naming the failed process, its host and what it was doing; SIGTERM ends
    the process cleanly; a process that made no step call for ``timeout``
    seconds (because another left the loop early, or stopped) ends the job
    naming who finished or fell behind.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator. Default:
        ``$JDP_COORDINATOR`` (set by ``jdp.launch``), else JAX's cluster
        auto-detection.
      num_processes: the number of processes (default as above).
      process_id: this process's index (default as above).
      local_device_ids: restrict this process to these local devices (GPUs).
        Under ``srun``/``mpirun`` JAX defaults to one GPU per process, chosen
        by the local rank: launch one task per GPU, or pass the ids.
      cpu_devices_per_process: force this many CPU devices in each process
        (``jdp.force_cpu_devices``), default ``$JDP_CPU_DEVICES_PER_PROCESS``;
        CPU collectives between processes use gloo. Each process's thread
        pool is sized for the whole job's devices (``PJRT_NPROC``, raised
        to ``2 * processes * cpu_devices_per_process``), so every process
        layout rounds alike.
      initialization_timeout: seconds to wait for every process to join.
      timeout: the stall deadline in seconds: a process with no step call for
        this long ends the job; JAX's heartbeat and shutdown-barrier timeouts
        use it too. Default ``$JDP_TIMEOUT`` (set by ``jdp.launch
        --timeout``), else 600 s for the stall deadline and JAX's defaults
        (100 s heartbeats, 300 s shutdown).
      **jax_kwargs: passed to ``jax.distributed.initialize``, e.g.
        ``cluster_detection_method="mpi4py"`` or ``coordinator_bind_address``.

    Raises:
      RuntimeError: called twice, or after JAX's backend already started (a
        collective, an array or ``jax.devices()`` came first).
      ValueError: a timeout JAX option is passed in ``jax_kwargs`` (use ``timeout``);
        ``timeout`` (or ``$JDP_TIMEOUT``) is not a positive number of seconds; the
        coordinator address is not ``host:port``.
    """
    where = "jdp.distributed.initialize"
    if num_processes is not None:
        check_int(num_processes, "num_processes", minimum=1, where=where)
    if process_id is not None:
        check_int(process_id, "process_id", minimum=0, where=where)
    _check_can_initialize(jax_kwargs)
    launched = ENV_COORDINATOR in os.environ
    coordinator_address, num_processes, process_id = _job(
        coordinator_address, num_processes, process_id, jax_kwargs
    )
    timeout = _stall_timeout(timeout)
    if coordinator_address is not None:
        check_address(coordinator_address)
    if cpu_devices_per_process is None and ENV_CPU_DEVICES in os.environ:
        cpu_devices_per_process = int(os.environ[ENV_CPU_DEVICES])
    if cpu_devices_per_process:
        size_cpu_pool(cpu_devices_per_process * _process_count(num_processes, jax_kwargs))
        force_cpu_devices(cpu_devices_per_process)
    _CALLED.append(True)
    if timeout is not None:
        # The shutdown barrier outwaits the stall watchdog, so a process that
        # finished early is named by the others instead of aborting first.
        jax_kwargs |= {
            "heartbeat_timeout_seconds": timeout,
            "shutdown_timeout_seconds": 2 * timeout + 10,
        }
    if coordinator_address is None and not _cluster_detected(jax_kwargs):
        _watchdog.install(timeout, _finish_before_exit)  # no launcher: one process
        return
    # Under jdp.launch inside a SLURM or Open MPI allocation, JAX's detection
    # would still pin each child to the GPU of the launcher's local rank.
    with _hidden(_CLUSTER_VARIABLES if launched else ()):
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout,
            **jax_kwargs,
        )
    _watchdog.install(timeout, _finish_before_exit)


def _job(
    address: str | None, count: int | None, index: int | None, jax_kwargs: dict[str, Any]
) -> tuple[str | None, int | None, int | None]:
    """The coordinator, process count and index: given, from jdp.launch, or exported."""
    env = os.environ
    if address is None and ENV_COORDINATOR in env:
        count = int(env[ENV_NUM_PROCESSES]) if count is None else count
        index = int(env[ENV_PROCESS_ID]) if index is None else index
        return env[ENV_COORDINATOR], count, index
    if (
        address is None
        and ENV_JAX_COORDINATOR in env
        and not _cluster_detected(jax_kwargs)  # a cluster gives the count and index itself
    ):
        return _exported(count, index)
    return address, count, index


def _stall_timeout(timeout: object) -> int | None:
    """``timeout=``, else ``$JDP_TIMEOUT``, as whole seconds (None: neither is set)."""
    if timeout is not None:
        return timeout_seconds(timeout, "timeout")
    if ENV_TIMEOUT in os.environ:
        return timeout_seconds(os.environ[ENV_TIMEOUT], f"${ENV_TIMEOUT}")
    return None


_OWN_OPTIONS = ("heartbeat_timeout_seconds", "shutdown_timeout_seconds")
# The variables whose presence makes JAX detect SLURM and Open MPI.
_CLUSTER_VARIABLES = ("SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri")


# Set once initialize() ran (a job of one process joins nothing, so JAX cannot tell).
_CALLED: list[bool] = []


def _check_can_initialize(jax_kwargs: dict[str, Any]) -> None:
    if _CALLED or jax.distributed.is_initialized():
        raise RuntimeError(
            "jdp.distributed.initialize() was already called in this process; call it once."
        )
    if _backend_started():
        raise RuntimeError(
            "jdp.distributed.initialize() must come before anything that starts "
            "JAX's backend (creating an array, jax.devices(), a jdp step). Move it "
            "to the top of the script."
        )
    clash = sorted(set(jax_kwargs) & set(_OWN_OPTIONS))
    if clash:
        raise ValueError(
            f"jdp.distributed.initialize: {clash} are set from timeout= (or $JDP_TIMEOUT); "
            "pass timeout=seconds instead."
        )


def _exported(num_processes: int | None, process_id: int | None) -> tuple[str, int, int]:
    """The job from ``JAX_COORDINATOR_ADDRESS`` and the count and index exported beside it."""
    env = os.environ
    address = env[ENV_JAX_COORDINATOR]
    if num_processes is None:
        num_processes = _int_variable(ENV_JAX_NUM_PROCESSES)
    for name in (ENV_JAX_PROCESS_ID, ENV_JOB_INDEX):
        if process_id is None:
            process_id = _int_variable(name)
    if num_processes is None or process_id is None:
        missing = ENV_JAX_NUM_PROCESSES if num_processes is None else ENV_JAX_PROCESS_ID
        raise ValueError(
            f"jdp.distributed.initialize: {ENV_JAX_COORDINATOR}={address!r} is set but "
            f"{missing} is not, and no launcher JAX knows (SLURM, Open MPI, ...) gives it. "
            f"Export {ENV_JAX_NUM_PROCESSES} (the number of processes) and {ENV_JAX_PROCESS_ID} "
            f"(this one's index; a Kubernetes Indexed Job or JobSet's {ENV_JOB_INDEX} serves), "
            f"or pass num_processes= and process_id=; for one process, unset {ENV_JAX_COORDINATOR}."
        )
    return address, num_processes, process_id


def timeout_seconds(value: object, name: str, where: str = "jdp.distributed.initialize") -> int:
    """A timeout as the whole positive seconds JAX takes, from a number or a variable's text.

    Example:
      >>> from jdp.distributed import timeout_seconds
      >>> timeout_seconds("30.5", "$JDP_TIMEOUT"), timeout_seconds(120, "timeout")
      (31, 120)
    """
    seconds = value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            seconds = float(value)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        kind = TypeError if not isinstance(value, str) else ValueError
        raise kind(
            f"{where}: {name} must be a number of seconds, got {value!r} "
            "(e.g. 600 for ten minutes)."
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{where}: {name} must be a positive number of seconds, got "
            f"{value!r}: it is how long a stalled job waits before it ends (e.g. 600)."
        )
    return math.ceil(seconds)


def check_address(address: object) -> None:
    """The coordinator address is ``host:port``: a URL or a bare host would hang the join."""
    where = "jdp.distributed.initialize: the coordinator address"
    if not isinstance(address, str):
        raise TypeError(f"{where} must be a 'host:port' string, got {address!r}.")
    if "://" in address:
        raise ValueError(
            f"{where} {address!r} is a URL; give host:port without a scheme, e.g. "
            f"{address.split('://', 1)[1].rstrip('/')!r}."
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{where} {address!r} is not host:port (e.g. 10.0.0.1:1234, the host of process 0 "
            "and a free port on it)."
        )


def _int_variable(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"jdp.distributed.initialize: ${name} must be an integer, got {text!r}."
        ) from None


def _process_count(num_processes: int | None, jax_kwargs: dict[str, Any]) -> int:
    """The job's process count before JAX starts: given, exported, or the launcher's (SLURM, ...)."""
    if num_processes is not None:
        return num_processes
    for cluster in _jax_private.cluster_types():
        # SLURM's and Open MPI's read their variables; others may ask a service.
        if cluster.__name__ in _COUNTS_FROM_VARIABLES and _present(cluster, jax_kwargs):
            with contextlib.suppress(Exception):  # a variable it could not read
                return int(cluster.get_process_count())
    return 1


_COUNTS_FROM_VARIABLES = ("SlurmCluster", "OmpiCluster")


def _cluster_detected(jax_kwargs: dict[str, Any]) -> bool:
    """Whether JAX's cluster detection finds a launcher (SLURM, Open MPI, Kubernetes, ...)."""
    return any(_present(env, jax_kwargs) for env in _jax_private.cluster_types())


def _present(cluster: Any, jax_kwargs: dict[str, Any]) -> bool:
    """Whether JAX's detection would pick ``cluster`` here (its variables, the method asked for)."""
    method = jax_kwargs.get("cluster_detection_method")
    chosen = cluster.name == method or (method is None and not cluster.opt_in_only_method)
    return chosen and cluster.is_env_present()


@contextlib.contextmanager
def _hidden(names: Sequence[str]) -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _finish_before_exit(timeout: float) -> None:
    """Finishes what the registered modules must finish (in-flight checkpoint saves)."""
    for finish in _BEFORE_FATAL_EXIT:
        finish(timeout)


def _backend_started() -> bool:
    # Called too late, JAX's own initialize can abort the process instead of raising.
    return _jax_private.backends_started()


def check_initialized() -> None:
    """Raises if ``jdp.launch`` started this process but it never joined the job.

    Without it, every process would silently train alone on its slice.
    """
    if ENV_COORDINATOR in os.environ and not _CALLED:
        raise RuntimeError(
            "jdp.distributed.initialize() was not called, but jdp.launch started this "
            f"process as process {os.environ.get(ENV_PROCESS_ID)} of "
            f"{os.environ.get(ENV_NUM_PROCESSES)}: alone, it would train on its slice only. "
            "Call jdp.distributed.initialize() first thing in the script."
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

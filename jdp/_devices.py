"""Forcing CPU devices safely, for tests, notebooks and laptops.

XLA's CPU client runs every device's computation on one thread pool of
``max(PJRT_NPROC or the core count, device count)`` threads. Python may
dispatch many steps ahead, and launch tasks for later steps hold pool threads
while they wait, so the n executions of the current step's all-reduce cannot
all join the rendezvous: on 2 cores with 8 forced devices, a pmap training run
stops for good within a few hundred steps and aborts after 40 s. A pool of at
least twice the device count never deadlocked in our runs (see
docs/concepts.md, "CPU devices").
"""

import os
import warnings

import jax

from jdp._args import check_int

THREADS_PER_DEVICE = 2


def force_cpu_devices(n: int) -> None:
    """Makes JAX run on ``n`` CPU devices with a deadlock-free thread pool.

    Call it right after ``import jax``, before any array is created. It sets
    ``jax_platforms="cpu"``, ``jax_num_cpu_devices=n`` and the environment
    variable ``PJRT_NPROC`` to at least ``2 * n`` (a larger value already set
    is kept). Calling it again with the same ``n`` once the backend runs is a
    no-op, so a notebook cell can be re-run.

    Args:
      n: the number of CPU devices, at least 1.

    Raises:
      TypeError: if ``n`` is not an int.
      ValueError: if ``n`` < 1.
      RuntimeError: if the JAX backend already started with another device
        count or an unsafe thread pool; restart the process (or kernel) and
        call this first.

    Example:
      >>> import jax, jdp
      >>> jdp.force_cpu_devices(8)
      >>> jax.device_count()
      8
    """
    check_int(n, "n", minimum=1, where="jdp.force_cpu_devices(n)")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if _started_safely_with(n):
            return
        raise RuntimeError(
            f"jdp.force_cpu_devices({n}) was called after the JAX backend started "
            f"(with {jax.device_count()} {jax.default_backend()} device(s), "
            f"PJRT_NPROC={os.environ.get('PJRT_NPROC')!r}). Call it right after "
            "`import jax`, before creating any array; in a notebook, restart "
            "the kernel."
        ) from None
    jax.config.update("jax_platforms", "cpu")
    size_cpu_pool(n)


def size_cpu_pool(job_devices: int) -> None:
    """Sizes this process's CPU thread pool for a job of ``job_devices`` CPU devices in all.

    XLA:CPU splits some operations into as many blocks as its pool has
    threads (a depthwise convolution's kernel gradient: a contraction over
    batch and space), so their rounding follows the pool size: 14 of a
    U-Net's 41 state leaves differed after 3 exact-mode steps between pools
    of 8 and 4 threads. Sized by the job's device count rather than the
    process's, every process layout of a job gets the pool one process
    holding every device gets (``2 * job_devices`` threads, or a larger
    ``PJRT_NPROC`` already set), so 2 x 2 processes compute what 1 x 4 does.
    Call before JAX's backend starts.
    """
    os.environ["PJRT_NPROC"] = str(max(THREADS_PER_DEVICE * job_devices, _env_threads()))


def _env_threads() -> int:
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _started_safely_with(n: int) -> bool:
    return (
        jax.default_backend() == "cpu"
        and jax.local_device_count() == n
        and _env_threads() >= THREADS_PER_DEVICE * n
    )


def warn_if_cpu_pool_unsafe(num_devices: int) -> None:
    """Warns when collectives over CPU devices may deadlock (see module doc)."""
    if jax.default_backend() != "cpu" or num_devices < 2:
        return
    threads = max(_env_threads() or (os.cpu_count() or 1), num_devices)
    if threads < THREADS_PER_DEVICE * num_devices:
        warnings.warn(
            f"{num_devices} CPU devices share a pool of {threads} threads; "
            "collectives can deadlock in XLA's CPU rendezvous when steps run "
            f"ahead. Set PJRT_NPROC>={THREADS_PER_DEVICE * num_devices} before "
            "JAX starts, or call jdp.force_cpu_devices(n) right after "
            "`import jax`.",
            RuntimeWarning,
            stacklevel=3,
        )

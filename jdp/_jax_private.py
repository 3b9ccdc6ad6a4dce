"""The three things jdp reads from JAX's private modules, in one place.

JAX has no public API for any of them. Each accessor is pinned by
``tests/test_jax_private.py``, which fails on the JAX release that moves or
renames what it reads, before a user meets an ``AttributeError`` mid-job.
"""

from typing import Any


def coordination_state() -> Any:
    """JAX's distributed state (``client``, ``process_id``, ``num_processes``).

    Read without starting the backend, so the caller may still configure it.
    """
    from jax._src import distributed

    return distributed.global_state


def cluster_types() -> list[Any]:
    """The launcher environments JAX's cluster detection knows (SLURM, Open MPI, ...).

    Each has ``name``, ``opt_in_only_method``, ``is_env_present()`` and
    ``get_process_count()``.
    """
    from jax._src import clusters

    return list(clusters.ClusterEnv._cluster_types)


def backends_started() -> bool:
    """Whether JAX has created its backends (too late for ``jax.distributed.initialize``)."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())

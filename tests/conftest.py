"""Test configuration: 8 CPU devices, forced once, before JAX starts.

Strict dtype promotion is not enabled: optax's own Adam (``decay ** count``)
fails under it. Warnings are errors (pyproject.toml).
"""

import pathlib

import pytest

import jdp

jdp.force_cpu_devices(8)

# The files that take longest (measured with --durations=0 on 2 cores), longest
# first. `make test` hands out whole files (--dist loadfile, so a module
# fixture is built once) in collection order, so these go first and the two
# workers end together. Only the order changes: a stale list costs balance,
# never a test.
LONGEST_FIRST = (
    "test_zoo.py",
    "test_zoo_processes.py",
    "test_fsdp.py",
    "test_fsdp_scan.py",
    "test_restarts.py",
    "test_examples.py",
    "test_failfast.py",
    "test_zero1.py",
    "test_verify.py",
    "test_pace.py",
    "test_survivors.py",
    "test_step.py",
    "test_notebooks.py",
    "test_audit.py",
    "test_replay.py",
    "test_misuse.py",
    "test_docs.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(pathlib.Path(str(item.path)).name, len(rank)))


@pytest.fixture(params=["shard_map", "pmap"])
def backend(request) -> str:
    """Every backend by name (``tests.models.backend`` builds it), the lead backend first."""
    return request.param

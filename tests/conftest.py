"""Test configuration: 8 CPU devices, forced once, before JAX starts.

Strict dtype promotion is not enabled: optax's own Adam (``decay ** count``)
fails under it. Warnings are errors (pyproject.toml).
"""

import pytest

import jdp

jdp.force_cpu_devices(8)


@pytest.fixture(params=["shard_map", "pmap"])
def backend(request) -> str:
    """Every backend by name (``tests.models.backend`` builds it), the lead backend first."""
    return request.param

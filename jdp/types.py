"""Type aliases shared by jdp's public API."""

from typing import Any, TypeAlias

PyTree: TypeAlias = Any
"""Any nested structure of lists, tuples, dicts, dataclasses and arrays."""

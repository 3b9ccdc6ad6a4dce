"""A split state's rows held twice: each process also holds the next process's rows.

``zero1`` and ``fsdp`` split leaves into rows, row i on device i of the data
axis, so no process holds all of them. One collective (a ``ppermute`` over
the data axis) copies every row ``k`` devices back, ``k`` being the devices
per process, so process p also holds process p + 1's rows and the loss of
any one process loses no row. :func:`in_step` runs it inside the step that
makes the rows, so the copy completes with the step; :func:`next_rows` runs
it on its own, for a state made outside a step.
"""

import functools
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_AXIS = "rows"


def in_step(rows: list[jax.Array], axis_name: str) -> list[jax.Array]:
    """Inside a step: each of this replica's rows, received from ``k`` replicas further along."""
    return lax.ppermute(rows, axis_name, perm=_pairs(lax.axis_size(axis_name)))


def _pairs(n: int) -> list[tuple[int, int]]:
    """Device j's row goes to device j - k: the previous process holds it."""
    k = jax.local_device_count()
    return [(j, (j - k) % n) for j in range(n)]


def next_rows(leaves: list[jax.Array]) -> list[jax.Array]:
    """Per split leaf, the rows ``k`` places further along the data axis, on this process's devices.

    Dispatched, not waited for: the copy runs after the step that made the leaves.
    """
    placed = [global_rows(x) for x in leaves]
    mesh = placed[0].sharding.mesh  # type: ignore[attr-defined]
    return _shift(mesh)(placed)


def global_rows(x: jax.Array) -> jax.Array:
    """``x`` as one array over the job's devices, row i on data-axis device i.

    Under pmap with several processes a split leaf holds this process's rows
    only, on a mesh of its own devices; its rows are placed by the index of
    their device among all the job's devices.
    """
    if not (x.is_fully_addressable and jax.process_count() > 1):
        return _on_rows_axis(x)
    devices = jax.devices()
    mesh = Mesh(np.array(devices), (_AXIS,))
    shards = sorted(x.addressable_shards, key=lambda s: devices.index(s.device))
    shape = (len(devices), *x.shape[1:])
    sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
    return jax.make_array_from_single_device_arrays(shape, sharding, [s.data for s in shards])


def _on_rows_axis(x: jax.Array) -> jax.Array:
    """A global split leaf on a one-axis mesh named ``rows`` (the same devices, in order)."""
    mesh = x.sharding.mesh  # type: ignore[attr-defined]
    devices = mesh.devices.reshape(-1)
    sharding = NamedSharding(Mesh(devices, (_AXIS,)), PartitionSpec(_AXIS))
    shards = {s.device: s.data for s in x.addressable_shards}
    arrays = [shards[d] for d in devices if d in shards]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, arrays)


@functools.lru_cache(maxsize=8)
def _shift(mesh: Mesh):
    pairs = _pairs(mesh.devices.size)
    spec = PartitionSpec(_AXIS)

    def shift(rows: Any) -> Any:
        return lax.ppermute(rows, _AXIS, perm=pairs)

    return jax.jit(jax.shard_map(shift, mesh=mesh, in_specs=spec, out_specs=spec))


def row_count(x: jax.Array) -> int:
    """The rows of a split leaf over the whole job (a pmap leaf holds this process's only)."""
    local = x.is_fully_addressable and jax.process_count() > 1
    return x.shape[0] * (jax.process_count() if local else 1)


def held(x: jax.Array, copy: jax.Array | None) -> dict[int, np.ndarray]:
    """The rows of ``x`` this process holds, its own and (``copy``) the next process's, by index."""
    rows = {_index(s): np.array(s.data)[0] for s in global_rows(x).addressable_shards}
    if copy is not None:
        n = row_count(x)
        k = jax.local_device_count()
        for s in global_rows(copy).addressable_shards:
            rows.setdefault((_index(s) + k) % n, np.array(s.data)[0])
    return rows


def _index(shard: Any) -> int:
    return int(shard.index[0].start or 0)

"""Where values live on the devices: the one module that knows layouts.

A replicated value is held in one of two layouts:

- :data:`LEADING_AXIS`: a leading device axis, row i on device i (the layout
  ``jax.pmap`` consumes and :func:`jdp.replicate` produces). Its arrays are
  sharded over a mesh whose one axis is :data:`DEVICE_AXIS`, so a pmap-layout
  batch ``(n, B // n, ...)`` is told apart from a global batch of ``n``
  examples by its sharding, not by its shape.
- :data:`MESH_REPLICATED`: one global array held whole by every device of a
  mesh (the layout of :func:`jdp.shard_map`).

:func:`layout_of` answers which layout a tree is in; replication,
checkpoints, the backends and ``jdp.testing`` ask it, and nothing else reads
``sharding.spec``.

Inside a :class:`PerReplica` node the replicas hold different parts of one
logical value (e.g. the optimizer state that :func:`jdp.strategies.zero1`
splits): such a node says how to read its logical value, which of its leaves
every replica holds alike, and how to place a logical value the way it is
placed itself. The core calls these methods and never names a strategy.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import _tree
from jdp._batching import DEVICE_AXIS
from jdp._tree import PyTree, is_prng_key

Replicate = Callable[[PyTree], PyTree]


class Placement(NamedTuple):
    """How a backend holds values on its devices, for a strategy's ``place``.

    Attributes:
      replicate: one host copy -> the backend's replicated layout.
      rows: ``(n, ...)`` host rows -> a device array with row i held by the
        device at index i of the data axis.
      size: n, the devices of the data axis.
    """

    replicate: Replicate
    rows: Callable[[Any], jax.Array]
    size: int


def place_rows(rows: np.ndarray, sharding: NamedSharding, row_of) -> jax.Array:
    """Host rows ``(n, ...)`` as one device array: each device gets row ``row_of(device)``.

    The layout of values a strategy places per replica (``sharding`` splits
    the leading axis); with several processes each places its own devices' rows.
    """
    axis = sharding.spec[0]  # the data axis: other axes of the mesh copy or split a row
    shape = (sharding.mesh.shape[axis],) + rows.shape[1:]
    within = sharding.addressable_devices_indices_map(shape)  # a row split over model axes
    arrays = []
    for d in sharding.addressable_devices:
        part = within[d] or ()
        block = rows[row_of(d)][None][(slice(None), *part[1:])]
        arrays.append(jax.device_put(block, d, may_alias=False))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def rows_like(x: jax.Array, size: int) -> Callable[[Any], jax.Array]:
    """``Placement.rows`` for rows placed as ``x`` (a per-replica leaf of ``size`` rows) is."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"jdp: a per-replica leaf must have a NamedSharding, got {sharding}.")
    mesh = sharding.mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"jdp: a per-replica leaf must live on a concrete Mesh, got {mesh}.")
    row_of: Callable[[jax.Device], int]
    if len(mesh.axis_names) > 1:  # a mesh with model axes: the row is the data index
        row_of = data_index(mesh, sharding.spec[0])
    elif mesh.size == size:
        row_of = list(mesh.devices.flat).index
    else:
        # pmap across processes: each process's mesh holds its own devices, and a
        # device's row is its index among every process's devices.
        row_of = jax.devices().index
    return lambda rows: place_rows(np.asarray(rows), sharding, row_of)


def _copy(x, sharding: NamedSharding, leading: bool) -> jax.Array:
    # One explicit copy per device: jax.device_put(x, sharding) reuses x's own
    # buffer for the device x lives on (even with may_alias=False), and
    # donating the replicated state would then delete the caller's array.
    x = jnp.asarray(x)
    if is_prng_key(x):
        data = _copy(jax.random.key_data(x), sharding, leading)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    block = x[None] if leading else x
    copies = [jax.device_put(block, d, may_alias=False) for d in sharding.addressable_devices]
    shape = (sharding.mesh.size,) + x.shape if leading else x.shape
    return jax.make_array_from_single_device_arrays(shape, sharding, copies)


def data_index(mesh: Mesh, axis: str) -> Callable[[jax.Device], int]:
    """Each device's index along ``axis`` of ``mesh``: the replica it computes."""
    rows = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    where = {d: i for i, row in enumerate(rows.reshape(len(rows), -1)) for d in row}
    return where.__getitem__


def _device_stacked(x) -> bool:
    return (
        isinstance(x, jax.Array)
        and x.ndim >= 1
        and isinstance(x.sharding, NamedSharding)
        and len(x.sharding.mesh.axis_names) == 1  # the pmap layout's mesh is 1-D
        and len(x.sharding.spec) >= 1
        and x.sharding.spec[0] is not None
        and x.shape[0] == x.sharding.mesh.size
    )


def _mesh_replicated(x) -> bool:
    # On a mesh with model axes a leaf is one global array, however the user
    # shards it over them: each replica reads all of it (a shard is no replica).
    return (
        isinstance(x, jax.Array)
        and isinstance(x.sharding, NamedSharding)
        and (len(x.sharding.mesh.axis_names) > 1 or all(a is None for a in x.sharding.spec))
    )


def _blocks(x: jax.Array) -> dict[tuple, list]:
    """This process's shards of ``x`` grouped by the block they hold, copies in mesh order."""
    position = {d: i for i, d in enumerate(x.sharding.mesh.devices.flat)}  # type: ignore[attr-defined]
    blocks: dict[tuple, list] = {}
    for shard in sorted(x.addressable_shards, key=lambda s: position[s.device]):
        key = tuple((i.start, i.stop) for i in shard.index)
        blocks.setdefault(key, []).append(shard)
    return blocks


def _assemble(x: jax.Array, copy: int) -> np.ndarray:
    """Copy ``copy`` of ``x`` read from its shards on the host (no computation dispatched)."""
    blocks = _blocks(x)
    if sum(shards[0].data.size for shards in blocks.values()) != x.size:
        raise ValueError(
            f"jdp: a leaf of shape {x.shape} is split over the model axes of {x.sharding} "
            "across processes, so this process cannot read a whole copy. Keep each model "
            "group within one process (the data axis may span processes)."
        )
    value = np.empty(x.shape, x.dtype)
    for shards in blocks.values():
        shard = shards[copy]
        value[shard.index] = np.asarray(shard.data)
    return value


def host_value(x: jax.Array) -> np.ndarray:
    """One whole copy of a mesh-replicated leaf, read from its shards on the host."""
    return _assemble(x, 0)


def _mesh_replica0(x: jax.Array) -> jax.Array:
    if x.sharding.is_fully_replicated:
        return x.addressable_shards[0].data
    return jax.device_put(_assemble(x, 0), x.addressable_shards[0].device)


def _mesh_replicas(x: jax.Array) -> list[np.ndarray]:
    copies = min(len(shards) for shards in _blocks(x).values())
    return [_assemble(x, i) for i in range(copies)]


def _first_row(x: jax.Array) -> jax.Array:
    # The first replica this process holds: replica 0 in a single process.
    first = min(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return first.data[0]


def _rows_on_host(x: jax.Array) -> list[np.ndarray]:
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return [row for s in shards for row in np.asarray(jax.device_get(s.data))]


def _stacked_global_copy(x: jax.Array) -> jax.Array:
    # One global replicated array from every device's row. Across processes
    # each holds its own devices' rows, so the mesh spans every process's
    # devices. (Orbax's fully_replicated_host_local_array_to_global_array does
    # this but keeps the leading axis when a process has one device: 4
    # processes x 1 device saved .step as shape (1,).)
    several = jax.process_count() > 1 and x.is_fully_addressable
    mesh = Mesh(np.array(jax.devices()), ("x",)) if several else x.sharding.mesh  # type: ignore[attr-defined]
    rows = [s.data[0] for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]
    return jax.make_array_from_single_device_arrays(
        x.shape[1:], NamedSharding(mesh, PartitionSpec()), rows
    )


class Layout(NamedTuple):
    """One way of holding a replicated value on the devices of a mesh.

    Attributes:
      name: for messages.
      matches: whether a leaf is held in this layout.
      copy: ``(value, mesh) -> array``: one host value placed in this layout.
      replica0: this process's first replica of a leaf (replica 0 in one process).
      replicas: every replica this process holds of a leaf, as host arrays.
      global_copy: a leaf as one global array replicated over its devices
        (what a checkpoint writes).
      spec: the ``PartitionSpec`` of its arrays on their mesh.
    """

    name: str
    matches: Callable[[Any], bool]
    copy: Callable[[Any, Mesh], jax.Array]
    replica0: Callable[[jax.Array], jax.Array]
    replicas: Callable[[jax.Array], list[np.ndarray]]
    global_copy: Callable[[jax.Array], jax.Array]
    spec: PartitionSpec


LEADING_AXIS = Layout(
    "a leading device axis (the pmap layout)",
    _device_stacked,
    lambda x, mesh: _copy(x, NamedSharding(mesh, PartitionSpec(mesh.axis_names[0])), True),
    _first_row,
    _rows_on_host,
    _stacked_global_copy,
    PartitionSpec(DEVICE_AXIS),
)

MESH_REPLICATED = Layout(
    "replicated across a mesh (the shard_map layout)",
    _mesh_replicated,
    lambda x, mesh: _copy(x, NamedSharding(mesh, PartitionSpec()), False),
    _mesh_replica0,
    _mesh_replicas,
    lambda x: x,
    PartitionSpec(),
)

LAYOUTS = (MESH_REPLICATED, LEADING_AXIS)


def layout_of_leaf(x: Any) -> Layout | None:
    """The layout of one replicated leaf, or None (a host value, one device)."""
    if is_prng_key(x):
        x = jax.random.key_data(x)
    if not isinstance(x, jax.Array):
        return None
    return next((layout for layout in LAYOUTS if layout.matches(x)), None)


def layout_of(tree: PyTree) -> Layout | None:
    """The one layout the replicated leaves of ``tree`` are in (None: not placed).

    Leaves a strategy placed per replica are left out. A tree with leaves in
    both layouts, or with a leaf spread over devices in neither, is refused
    naming the leaf.
    """
    found: tuple[str, Layout] | None = None
    for path, leaf in jax.tree_util.tree_flatten_with_path(shared(tree))[0]:
        name = jax.tree_util.keystr(path) or "<root>"
        layout = layout_of_leaf(leaf)
        if layout is None:
            if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
                raise ValueError(
                    f"jdp: leaf {name} (shape {leaf.shape}, sharding {leaf.sharding}) is spread over "
                    "devices in neither jdp layout (a leading device axis, or replicated "
                    "across a mesh). Place the tree with a step's replicate."
                )
            continue
        if found is not None and found[1] is not layout:
            raise ValueError(
                f"jdp: the tree mixes layouts: leaf {found[0]} is held with {found[1].name}, leaf "
                f"{name} with {layout.name}. Place it once: tree = step.replicate(tree)."
            )
        found = (name, layout)
    return None if found is None else found[1]


def mesh_of(tree: PyTree) -> Mesh | None:
    """The mesh the first placed leaf of ``tree`` lives on (None: none is placed)."""
    for leaf in jax.tree.leaves(shared(tree)):
        if is_prng_key(leaf):
            leaf = jax.random.key_data(leaf)
        if layout_of_leaf(leaf) is not None:
            return leaf.sharding.mesh
    return None


@runtime_checkable
class PerReplica(Protocol):
    """A placed pytree node whose replicas hold different parts of one value."""

    def logical(self, read: Callable[[Any], Any]) -> PyTree:
        """The logical value on the host; ``read`` gives one copy of a replicated leaf."""
        ...

    def shared(self) -> PyTree:
        """The node with its per-replica leaves replaced by None (for in-sync checks)."""
        ...

    def place_like(self, value: PyTree, replicate: Replicate) -> "PerReplica":
        """``value`` (a logical value) placed as this node is; ``replicate`` for shared leaves."""
        ...


def is_per_replica(x: object) -> bool:
    return isinstance(x, PerReplica)


def has_per_replica(tree: PyTree) -> bool:
    return any(is_per_replica(x) for x in jax.tree.leaves(tree, is_leaf=is_per_replica))


def logical(tree: PyTree, read: Callable[[Any], Any]) -> PyTree:
    """Every leaf through ``read``; per-replica nodes as their logical value."""
    return jax.tree.map(
        lambda x: x.logical(read) if is_per_replica(x) else read(x), tree, is_leaf=is_per_replica
    )


def shared(tree: PyTree) -> PyTree:
    """``tree`` without the leaves that differ between replicas by design."""
    return jax.tree.map(
        lambda x: x.shared() if is_per_replica(x) else x, tree, is_leaf=is_per_replica
    )


def place_like(template: PyTree, value: PyTree, replicate: Replicate) -> PyTree:
    """``value`` (logical, one copy) placed like ``template``.

    Per-replica nodes of ``template`` place their part of ``value`` themselves;
    everything else goes through ``replicate`` in one call.
    """
    nodes = jax.tree.leaves(template, is_leaf=is_per_replica)
    if not any(is_per_replica(x) for x in nodes):
        return replicate(value)
    structure = _tree.structure(template, is_leaf=is_per_replica)
    parts = structure.flatten_up_to(value)
    holes = [None if is_per_replica(t) else p for t, p in zip(nodes, parts, strict=True)]
    placed = structure.flatten_up_to(replicate(structure.unflatten(holes)))
    out = [
        t.place_like(p, replicate) if is_per_replica(t) else q
        for t, p, q in zip(nodes, parts, placed, strict=True)
    ]
    return structure.unflatten(out)


def per_replica_leaves(tree: PyTree) -> list[bool]:
    """Per leaf of ``tree`` (in flatten order): whether each replica holds its own part.

    Read from the structure alone (it works on tracers): a per-replica node
    marks the leaves its :meth:`PerReplica.shared` leaves out.
    """
    out: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=is_per_replica):
        if is_per_replica(node):
            kept = jax.tree.leaves(node.shared(), is_leaf=lambda x: x is None)
            out.extend(x is None for x in kept)
        else:
            out.append(False)
    return out

"""One copy of a pytree per device: replicate, read back, broadcast, check."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import _layout
from jdp._batching import AXIS_NAME, leaves_with_paths, local_mesh
from jdp._tree import PyTree, is_prng_key
from jdp.distributed import from_process0


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Puts one identical copy of ``tree`` on every local device.

    Each leaf of shape ``S`` becomes an array of shape ``(n, *S)`` sharded
    along its leading axis, the layout ``jax.pmap`` consumes and produces.
    This is the initial parameter sync of data-parallel training; with
    several processes, every process first receives process 0's values, so
    all start identical even when they were seeded differently.

    Args:
      tree: a pytree of arrays or Python/NumPy scalars.
      devices: the devices (default: ``jax.local_devices()``).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> jdp.replicate({"w": jnp.ones(3)})["w"].shape
      (8, 3)
    """
    _check_single_copy(tree, "replicate")
    sharding = NamedSharding(local_mesh(devices), PartitionSpec(AXIS_NAME))
    return jax.tree.map(lambda x: _copy_to_every_device(x, sharding), from_process0(tree))


def _check_single_copy(tree: PyTree, what: str) -> None:
    """Refuses a tree that is already spread over several devices."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            raise ValueError(
                f"{what}: leaf {jax.tree_util.keystr(path) or '<root>'} is already on "
                f"{len(x.sharding.device_set)} devices (shape {x.shape}); {what} takes one "
                "copy. Was the tree replicated already? Pass it as it is, or "
                f"{what}(jdp.unreplicate(tree)) to re-place it."
            )


def replicate_across(tree: PyTree, mesh: Mesh) -> PyTree:
    """One global copy of ``tree`` held whole on every device of ``mesh``.

    The state layout of :func:`jdp.shard_map`: no leading device axis. With
    several processes, process 0's values are used everywhere.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> w = jdp.replicate_across({"w": jnp.ones(3)}, jax.make_mesh((8,), ("batch",)))["w"]
      >>> w.shape, w.sharding.is_fully_replicated
      ((3,), True)
    """
    _check_single_copy(tree, "replicate_across")
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: _copy_to_every_device(x, sharding), from_process0(tree))


def _copy_to_every_device(x, sharding: NamedSharding) -> jax.Array:
    # One explicit copy per device: jax.device_put(x, sharding) reuses x's own
    # buffer for the device x lives on (even with may_alias=False), and
    # donating the replicated state would then delete the caller's array.
    x = jnp.asarray(x)
    if is_prng_key(x):
        data = _copy_to_every_device(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    leading = sharding.spec != PartitionSpec()
    block = x[None] if leading else x
    copies = [jax.device_put(block, d, may_alias=False) for d in sharding.addressable_devices]
    shape = (sharding.mesh.size,) + x.shape if leading else x.shape
    return jax.make_array_from_single_device_arrays(shape, sharding, copies)


def place_rows(rows: np.ndarray, sharding: NamedSharding, row_of) -> jax.Array:
    """Host rows ``(n, ...)`` as one device array: each device gets row ``row_of(device)``.

    The layout of values a strategy places per replica (``sharding`` splits
    the leading axis); with several processes each places its own devices' rows.
    """
    arrays = [
        jax.device_put(rows[row_of(d)][None], d, may_alias=False)
        for d in sharding.addressable_devices
    ]
    shape = (sharding.mesh.size,) + rows.shape[1:]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def unreplicate(tree: PyTree) -> PyTree:
    """Returns replica 0 of a replicated pytree, without a global gather.

    Works on both layouts: a leading device axis (``jdp.replicate``, pmap
    outputs) and global arrays replicated across a mesh
    (``jdp.shard_map(...).replicate``), whose local copy is returned.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> jdp.unreplicate(jdp.replicate({"w": jnp.ones(3)}))["w"].shape
      (3,)
    """
    _check_replicated(tree, "unreplicate")
    # State a strategy placed per replica (e.g. a split optimizer state) comes back whole.
    return _layout.logical(tree, _replica0)


def _check_replicated(tree: PyTree, what: str) -> None:
    """Refuses trees that were never replicated (whose row 0 is not a replica)."""
    for name, leaf in leaves_with_paths(tree, f"{what} input"):
        if _is_mesh_replicated(leaf) or _is_device_stacked(leaf):
            continue
        raise ValueError(
            f"{what} expects a replicated tree (jdp.replicate, a step's state or "
            f"outputs), but leaf {name} (shape {leaf.shape}) "
            + (
                "lives on a single device: it was never replicated."
                if isinstance(leaf, jax.Array)
                else f"is a host {type(leaf).__name__}, not a replicated jax.Array."
            )
        )


def _is_device_stacked(x) -> bool:
    """A leading device axis sharded one row per device (the pmap layout)."""
    return (
        isinstance(x, jax.Array)
        and x.ndim >= 1
        and isinstance(x.sharding, NamedSharding)
        and len(x.sharding.spec) >= 1
        and x.sharding.spec[0] is not None
        and x.shape[0] == x.sharding.mesh.size
    )


def _is_mesh_replicated(x) -> bool:
    """A global array held whole on every device (the shard_map layout)."""
    return (
        isinstance(x, jax.Array)
        and isinstance(x.sharding, NamedSharding)
        and all(axis is None for axis in x.sharding.spec)
    )


def _replica0(x):
    if _is_mesh_replicated(x):
        return x.addressable_shards[0].data
    # The first replica this process holds: replica 0 in a single process.
    first = min(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return first.data[0]


def gather_replicas(tree: PyTree) -> PyTree:
    """Every replica's values from every process, as host NumPy arrays.

    For per-replica outputs such as a step's metrics: each leaf comes back
    with a leading axis over all replicas of the job, in replica order. With
    several processes this is a collective.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> out = jax.pmap(lambda x: x * 2, axis_name="batch")(jnp.arange(8.0))
      >>> jdp.gather_replicas({"y": out})["y"].tolist()
      [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    """
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)

    def gather(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(
            multihost_utils.process_allgather(np.asarray(jax.device_get(x)), tiled=True)
        )

    return jax.tree.map(gather, tree)


def sync_replicas(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Copies replica 0 to every device, outside a step (e.g. after a restore).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> state = jdp.sync_replicas(jdp.replicate({"w": jnp.ones(3)}))
      >>> jdp.assert_replicas_in_sync(state)
    """
    copy = from_process0(unreplicate(tree))
    leading = NamedSharding(local_mesh(devices), PartitionSpec(AXIS_NAME))

    def place(x, value):
        return _copy_to_every_device(value, x.sharding if _is_mesh_replicated(x) else leading)

    return jax.tree.map(place, tree, copy)


def broadcast(tree: PyTree, axis_name: str = AXIS_NAME, source: int = 0) -> PyTree:
    """Inside a step: every replica receives replica ``source``'s values.

    Caffe2's ``_Broadcast`` as a collective over ``axis_name``.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> f = jax.pmap(lambda x: jdp.broadcast(x, "batch", 3), axis_name="batch")
      >>> f(jnp.arange(8.0)).tolist()
      [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    """
    if isinstance(source, bool) or not isinstance(source, int) or source < 0:
        raise ValueError(f"broadcast: source must be a replica index >= 0, got {source!r}.")
    n = lax.axis_size(axis_name)
    if source >= n:
        raise ValueError(
            f"broadcast: source={source} but axis {axis_name!r} has {n} replicas "
            f"(indices 0..{n - 1})."
        )
    return jax.tree.map(lambda x: _pbroadcast(x, axis_name, source), tree)


def _pbroadcast(x, axis_name, source):
    # lax.pbroadcast is not lowered under pmap; a masked psum is exact (every
    # other replica adds zeros) and runs under both backends.
    dtype = x.dtype
    if dtype == jnp.bool_:
        x = x.astype(jnp.int32)
    masked = jnp.where(lax.axis_index(axis_name) == source, x, jnp.zeros_like(x))
    return lax.psum(masked, axis_name).astype(dtype)


def assert_replicas_in_sync(tree: PyTree, atol: float = 0.0) -> None:
    """Raises if any replica of any leaf differs from replica 0 by more than ``atol``.

    NaNs in the same places count as equal. State that a strategy places per
    replica (the optimizer state rows of :func:`jdp.strategies.zero1`) differs
    by design and is skipped.

    With several processes, each process's replicas are also compared with
    process 0's (a collective: every process must call it).

    Raises:
      AssertionError: naming the first differing leaf path, the replica (or
        process) and the largest absolute difference.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> jdp.assert_replicas_in_sync(jdp.replicate({"w": jnp.ones(3)}))
    """
    several = jax.process_count() > 1
    tree = _layout.shared(tree)
    _check_replicated(tree, "assert_replicas_in_sync")
    for name, leaf in leaves_with_paths(tree, "assert_replicas_in_sync input"):
        replicas = _replicas(leaf)
        _assert_rows_close(name, replicas, atol, "replica", "Replicas", "replica 0")
        if several:
            rows = list(np.asarray(multihost_utils.process_allgather(replicas[0])))
            _assert_rows_close(name, rows, atol, "process", "Processes", "process 0's replica 0")


def _assert_rows_close(
    name: str, rows: list[np.ndarray], atol: float, kind: str, title: str, source: str
) -> None:
    for i, other in enumerate(rows[1:], start=1):
        if not _close(rows[0], other, atol):
            diff = np.abs(rows[0].astype(np.float64) - other.astype(np.float64))
            raise AssertionError(
                f"{title} out of sync at leaf {name}: {kind} {i} differs "
                f"from {kind} 0 by up to {np.nanmax(diff):.6g} (atol={atol}). "
                f"Call jdp.sync_replicas(tree) to re-broadcast {source}."
            )


def _replicas(x) -> list[np.ndarray]:
    if is_prng_key(x):
        x = jax.random.key_data(x)
    if _is_mesh_replicated(x):
        return [np.asarray(jax.device_get(s.data)) for s in x.addressable_shards]
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    blocks = [np.asarray(jax.device_get(s.data)) for s in shards]
    return [row for block in blocks for row in block]


def _close(a: np.ndarray, b: np.ndarray, atol: float) -> bool:
    if a.dtype.kind not in "fc":
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=0.0, atol=atol, equal_nan=True)

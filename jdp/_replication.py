"""One copy of a pytree per device: replicate, read back, broadcast, check."""

import math
import numbers
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import _layout
from jdp._args import bound_axis_size, check_int
from jdp._batching import AXIS_NAME, leaves_with_paths, local_mesh
from jdp._tree import PyTree, is_prng_key
from jdp.distributed import from_process0


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Puts one identical copy of ``tree`` on every local device, in the pmap layout.

    Each leaf of shape ``S`` becomes an array of shape ``(n, *S)`` sharded
    along its leading axis, the layout ``jax.pmap`` consumes and produces.
    This is the initial parameter sync of data-parallel training; with
    several processes, every process first receives process 0's values, so
    all start identical even when they were seeded differently. A
    :func:`jdp.shard_map` step takes this layout too (it re-places the state
    once); ``step.replicate`` places a state as its own backend holds it.

    Args:
      tree: a pytree of arrays or Python/NumPy scalars.
      devices: the devices (default: ``jax.local_devices()``).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> jdp.replicate({"w": jnp.ones(3)})["w"].shape
      (8, 3)
    """
    _check_single_copy(tree, "jdp.replicate")
    return _copies(from_process0(tree), _layout.LEADING_AXIS, local_mesh(devices))


def _copies(tree: PyTree, layout: _layout.Layout, mesh: Mesh) -> PyTree:
    return jax.tree.map(lambda x: layout.copy(x, mesh), tree)


def _check_single_copy(tree: PyTree, what: str) -> None:
    """Refuses a tree a step consumed, or one already spread over several devices."""
    refuse_consumed(tree, what)
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
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "jdp.replicate_across: mesh must be a jax.sharding.Mesh, e.g. "
            f"jax.make_mesh((8,), ('batch',)), got {type(mesh).__name__}."
        )
    _check_single_copy(tree, "jdp.replicate_across")
    return _copies(from_process0(tree), _layout.MESH_REPLICATED, mesh)


def placement(layout: _layout.Layout, mesh: Mesh, rows: NamedSharding, row_of) -> _layout.Placement:
    """What a backend holding its state in ``layout`` on ``mesh`` gives a strategy's ``place``.

    ``rows`` splits a per-replica value's leading axis; ``row_of(device)`` is
    the device's index on the data axis.
    """

    def replicate_tree(tree: PyTree) -> PyTree:
        _check_single_copy(tree, "jdp.replicate")
        return _copies(from_process0(tree), layout, mesh)

    return _layout.Placement(
        replicate_tree,
        partial(_layout.place_rows, sharding=rows, row_of=row_of),
        mesh.shape[rows.spec[0]],
    )


def place_like(template: PyTree, value: PyTree) -> PyTree:
    """``value`` (one logical copy) placed the way the placed tree ``template`` is.

    Replicated leaves go into ``template``'s layout on its mesh, split over
    its model axes as ``template``'s are; a strategy's per-replica nodes place
    their own parts.
    """
    layout = _layout.layout_of(template) or _layout.LEADING_AXIS
    mesh = _layout.mesh_of(template) or local_mesh()
    if layout is _layout.LEADING_AXIS:  # host-local rows, as jdp.replicate places them
        mesh = local_mesh([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    placed = _layout.place_like(template, value, lambda tree: _copies(tree, layout, mesh))
    return placed if len(mesh.axis_names) == 1 else _split_as(template, placed)


def _split_as(template: PyTree, placed: PyTree) -> PyTree:
    """``placed``'s replicated leaves split over the model axes as ``template``'s are."""

    def one(t, p):
        if _layout.is_per_replica(t) or not isinstance(t, jax.Array) or t.sharding == p.sharding:
            return p
        return jax.device_put(p, t.sharding)

    return jax.tree.map(one, template, placed, is_leaf=_layout.is_per_replica)


def unreplicate(tree: PyTree) -> PyTree:
    """Returns replica 0 of a replicated pytree, without a global gather.

    Works on both layouts: a leading device axis (``jdp.replicate``, pmap
    outputs) and global arrays replicated across a mesh
    (``jdp.shard_map(...).replicate``), whose local copy is returned. State a
    strategy placed per replica (e.g. zero1's split optimizer state) comes
    back whole.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> jdp.unreplicate(jdp.replicate({"w": jnp.ones(3)}))["w"].shape
      (3,)
    """
    _check_replicated(tree, "jdp.unreplicate")
    return _layout.logical(tree, _replica0)


def _check_replicated(tree: PyTree, what: str) -> None:
    """Refuses trees that were never replicated (whose row 0 is not a replica)."""
    refuse_consumed(tree, what)
    for name, leaf in leaves_with_paths(tree, f"{what}: the input"):
        if _layout.layout_of_leaf(leaf) is not None:
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


def refuse_consumed(tree: PyTree, what: str) -> None:
    """Refuses a tree whose buffers a step donated, naming the leaf (before JAX's bare error)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        tracer = isinstance(leaf, jax.core.Tracer)
        if isinstance(leaf, jax.Array) and not tracer and leaf.is_deleted():
            name = jax.tree_util.keystr(path) or "<root>"
            raise RuntimeError(
                f"{what}: leaf {name} was consumed by an earlier step call: {CONSUMED}"
            )


CONSUMED = (
    "steps donate their input state's buffers to the new state (jdp.pmap/jdp.shard_map "
    "donate_state). Use the state the step returned (state, metrics = step(state, batch)); "
    "after re-running a notebook cell, re-create or restore the state."
)


def _replica0(x):
    layout = _layout.layout_of_leaf(x)
    if layout is None:
        raise ValueError(f"jdp: not a replicated array: shape {np.shape(x)}.")
    if is_prng_key(x):
        data = layout.replica0(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return layout.replica0(x)


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
    refuse_consumed(tree, "jdp.gather_replicas")
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)

    def gather(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(
            multihost_utils.process_allgather(np.asarray(jax.device_get(x)), tiled=True)
        )

    return jax.tree.map(gather, tree)


def sync_replicas(tree: PyTree) -> PyTree:
    """Copies replica 0 to every device, outside a step (e.g. after a restore).

    Either layout, and every strategy's state: values a strategy placed per
    replica (zero1's optimizer slices) are re-placed from replica 0's
    logical value. With several processes, process 0's values are used.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> state = jdp.sync_replicas(jdp.replicate({"w": jnp.ones(3)}))
      >>> jdp.assert_replicas_in_sync(state)
    """
    return place_like(tree, from_process0(unreplicate(tree)))


def broadcast(tree: PyTree, axis_name: str = AXIS_NAME, source: int = 0) -> PyTree:
    """Inside a step: every replica receives replica ``source``'s values.

    Caffe2's ``_Broadcast`` as a collective over ``axis_name``.

    Example:
      >>> import jax, jax.numpy as jnp, jdp
      >>> f = jax.pmap(lambda x: jdp.broadcast(x, "batch", 3), axis_name="batch")
      >>> f(jnp.arange(8.0)).tolist()
      [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    """
    check_int(source, "source (a replica index)", minimum=0, where="jdp.broadcast")
    n = bound_axis_size(axis_name, "jdp.broadcast")
    if source >= n:
        raise ValueError(
            f"jdp.broadcast: source={source} but axis {axis_name!r} has {n} replicas "
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
    _check_tolerance(atol)
    several = jax.process_count() > 1
    tree = _layout.shared(tree)
    _check_replicated(tree, "jdp.assert_replicas_in_sync")
    for name, leaf in leaves_with_paths(tree, "jdp.assert_replicas_in_sync: the input"):
        replicas = replica_rows(leaf)
        _assert_rows_close(name, replicas, atol, "replica", "Replicas", "replica 0")
        if several:
            rows = list(np.asarray(multihost_utils.process_allgather(replicas[0])))
            _assert_rows_close(name, rows, atol, "process", "Processes", "process 0's replica 0")


def _check_tolerance(atol: object) -> None:
    if isinstance(atol, bool) or not isinstance(atol, numbers.Real):
        raise TypeError(
            "jdp.assert_replicas_in_sync: atol must be a number >= 0 (the largest absolute "
            f"difference allowed; 0.0: bitwise), got {atol!r} ({type(atol).__name__})."
        )
    if not float(atol) >= 0 or not math.isfinite(atol):
        raise ValueError(
            "jdp.assert_replicas_in_sync: atol must be a finite number >= 0 (the largest "
            f"absolute difference allowed; 0.0: bitwise), got {atol!r}."
        )


def _assert_rows_close(
    name: str, rows: list[np.ndarray], atol: float, kind: str, title: str, source: str
) -> None:
    for i, other in enumerate(rows[1:], start=1):
        if not _close(rows[0], other, atol):
            diff = np.abs(rows[0].astype(np.float64) - other.astype(np.float64))
            raise AssertionError(
                f"jdp.assert_replicas_in_sync: {title.lower()} out of sync at leaf {name}: "
                f"{kind} {i} differs from {kind} 0 by up to {np.nanmax(diff):.6g} (atol={atol}). "
                f"Call jdp.sync_replicas(tree) to re-broadcast {source}."
            )


def replica_rows(x) -> list[np.ndarray]:
    """Each replica's copy of a replicated leaf, as host arrays, in replica order."""
    if is_prng_key(x):
        x = jax.random.key_data(x)
    layout = _layout.layout_of_leaf(x)
    if layout is None:
        raise ValueError(
            f"jdp: not a replicated array: shape {np.shape(x)}, sharding {x.sharding}."
        )
    return layout.replicas(x)


def _close(a: np.ndarray, b: np.ndarray, atol: float) -> bool:
    if a.dtype.kind not in "fc":
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=0.0, atol=atol, equal_nan=True)


def check_replicas_agree(tree: PyTree, where: str) -> None:
    """Refuses a tree in the pmap layout whose replicas hold different values.

    One pass over the state on the devices and one small transfer, so the
    backends run it on their first call and :func:`jdp.fit` once: a state
    built by ``jax.pmap(init)(keys)`` would otherwise train n separate models.
    Values a strategy places per replica are left out. Each process compares
    the rows on its own devices, with no collective between processes: a
    blocking collective here would keep a process that receives SIGTERM from
    ending cleanly while another has already left (measured: one of two
    ranks aborted with SIGABRT under load). Processes agree by construction,
    since :func:`jdp.replicate` takes process 0's values.
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
        return
    named = [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(_layout.shared(tree))[0]
        if _layout.layout_of_leaf(leaf) is _layout.LEADING_AXIS and leaf.shape[0] > 1
    ]
    if not named:
        return
    leaves = [_local_rows(x) for _, x in named]
    sharding = leaves[0].sharding
    if not isinstance(sharding, NamedSharding):  # the pmap layout is always named
        return
    agree = np.asarray(_rows_agree(leaves, NamedSharding(sharding.mesh, PartitionSpec())))
    for (name, _), rows in zip(named, agree, strict=True):
        if not rows.all():
            raise ValueError(
                f"{where}: the state's replicas disagree: leaf {name} on replica "
                f"{int(np.argmin(rows))} differs from replica 0, so each replica would train "
                "its own model. Place one copy on every device: "
                "state = step.replicate(jdp.unreplicate(state)) (initialise the state once, "
                "not per device as jax.pmap(init)(keys) does)."
            )


def _local_rows(x: jax.Array) -> jax.Array:
    """The rows this process holds, as an array over its own devices (no copy)."""
    if x.is_fully_addressable:
        return x
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    mesh = local_mesh([s.device for s in shards])
    shape = (sum(s.data.shape[0] for s in shards), *x.shape[1:])
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    return jax.make_array_from_single_device_arrays(shape, sharding, [s.data for s in shards])


@partial(jax.jit, static_argnums=1)
def _rows_agree(leaves: list[jax.Array], replicated: NamedSharding) -> jax.Array:
    """``(leaves, n)`` booleans: whether row i of each leaf equals its row 0 (NaNs alike)."""

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        same = x == x[:1]
        if jnp.issubdtype(x.dtype, jnp.inexact):
            same |= jnp.isnan(x) & jnp.isnan(x[:1])
        return jnp.all(same.reshape(x.shape[0], -1), axis=1)

    return jax.lax.with_sharding_constraint(jnp.stack([one(x) for x in leaves]), replicated)

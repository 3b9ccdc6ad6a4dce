"""The shard_map backend: replicated global state, a globally sharded batch."""

from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import _layout, _tree
from jdp._batching import (
    AXIS_NAME,
    DEVICE_AXIS,
    device_list,
    divisible_batch_size,
    refuse_placed,
)
from jdp._replication import placement
from jdp._steps import EvalStep, TrainStep
from jdp._tree import PyTree
from jdp.backends._checks import (
    check_global_batch,
    check_per_replica_rows,
    check_state,
    mesh_names,
)
from jdp.backends._runner import NO_CALL_INTO, Backend, Compiled, K, Metrics, Step, T, _traced


class ShardMapStep(Backend[K]):
    """A step run by ``jax.jit(jax.shard_map(...))`` over the data axis of a device mesh.

    State is held once, as global arrays replicated across the mesh (no
    leading device axis); the batch is a global ``(B, ...)`` array sharded
    along its leading axis. Per-replica metrics keep a leading axis of size n,
    as under pmap. Built by :func:`jdp.shard_map`. A state placed by
    :func:`jdp.replicate` (the pmap layout) is re-placed on its first call,
    and a batch from :func:`jdp.shard` is merged back into the global batch
    inside the step (no copy).
    """

    name = "shard_map"
    layout = _layout.MESH_REPLICATED
    # A step that keeps its state allocates a new one each call; jdp.fit hands
    # it an older state to write into instead (benchmarks/survivors.py: 1.05x
    # the donating step against 1.16x with new buffers, bench MLP, 8 CPU
    # devices, medians of 6 fresh processes).
    recycles = True
    _fn_into: Compiled | None = None

    def __init__(self, step: Step, *, mesh: Mesh | None, axis_name: str, donate_state: bool | None):
        if mesh is None:
            mesh = Mesh(np.asarray(jax.devices()), (axis_name,))
        if not isinstance(mesh, Mesh):
            raise TypeError(f"jdp.shard_map: mesh must be a jax.sharding.Mesh, got {mesh!r}.")
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"jdp.shard_map: the mesh has no data axis {axis_name!r} (its axes are "
                f"{mesh.axis_names}); name it, e.g. jax.make_mesh((n,), ({axis_name!r},)) "
                f"or jax.make_mesh((n, m), ({axis_name!r}, 'model'))."
            )
        self.mesh = mesh
        self.host_callbacks = len(mesh.axis_names) == 1
        self._size = mesh.shape[axis_name]
        self._row_of = _layout.data_index(mesh, axis_name)
        self._sharded = NamedSharding(mesh, PartitionSpec(axis_name))
        self._setup(step, axis_name, donate_state, mesh.size)
        self._build()

    def with_step(self, step: K) -> "ShardMapStep[K]":
        return ShardMapStep(
            step, mesh=self.mesh, axis_name=self.axis_name, donate_state=self.donates_state
        )

    def _replica_devices(self) -> list[jax.Device]:
        # With model axes a replica spans a group of devices: named by its first.
        first: dict[int, jax.Device] = {}
        for device in self.mesh.devices.flat:
            first.setdefault(self._row_of(device), device)
        return [first[i] for i in range(self._size)]

    def _compile(self, options: bool) -> Compiled:
        def jitted(**shardings):
            return jax.jit(
                self._run,
                donate_argnums=self._donate,
                compiler_options=self.step.compiler_options if options else None,
                **shardings,
            )

        return self._keeping_shardings(jitted)

    def _keeping_shardings(self, jitted: Callable[..., Compiled]) -> Compiled:
        """``jitted()``, or on a mesh with model axes, a :class:`_ModelAxes` around it."""
        if len(self.mesh.axis_names) == 1:
            return jitted()
        replicas = Mesh(np.asarray(self._replica_devices()), (self.axis_name,))
        rows = NamedSharding(replicas, PartitionSpec(self.axis_name))
        return _ModelAxes(jitted, rows, self.step.returns_state)

    def call_into(self, state: T, batch: PyTree, spare: list[jax.Array]) -> tuple[T, Metrics]:
        """Runs a training step that keeps its state, writing the new state into ``spare``.

        ``spare`` (arrays shaped and placed like the state's array leaves: an
        older state nothing reads any more) is donated as an argument the step
        does not read, and XLA writes the outputs into its buffers, so a step
        with ``donate_state=False`` allocates no new state. ``jdp.fit`` calls
        it when it keeps states for the survivors' copy.

        Raises:
          ValueError: if the step donates its state already.

        Example:
          >>> import jax, jax.numpy as jnp, optax, jdp
          >>> step = jdp.shard_map(
          ...     jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)), donate_state=False)
          >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.375)))
          >>> spare = [jnp.zeros_like(x) for x in jax.tree.leaves(state)]
          >>> new, _ = step.call_into(state, step.shard(jnp.ones((8, 3))), spare)
          >>> all(x.is_deleted() for x in spare), float(new.params[0]), float(state.params[0])
          (True, 0.75, 1.0)
        """
        if self.donates_state:
            raise ValueError(NO_CALL_INTO.format(name=self.name))
        if _traced(state):  # an outer jit allocates its outputs: nothing to write into
            return self._checked_call(state, batch)
        return self._checked_call(state, batch, spare)

    def _into(self, spare: list[jax.Array]) -> Compiled:
        if self._fn_into is None:
            # keep_unused: an unread argument is otherwise pruned, and its buffers
            # with it, so nothing would be written into them.
            self._fn_into = self._keeping_shardings(
                lambda **shardings: jax.jit(
                    lambda state, batch, spare: self._run(state, batch),
                    donate_argnums=(2,),
                    keep_unused=True,
                    compiler_options=self.step.compiler_options,
                    **shardings,
                )
            )
        into: Callable[..., Any] = self._fn_into
        return lambda state, batch: into(state, batch, spare)

    def _run(self, state: PyTree, batch: PyTree) -> PyTree:
        """Traced once per input structure: the checks, then the mapped step."""
        n = self._size
        check_state(state, n, self.layout, "jdp.shard_map step")
        check_per_replica_rows(state, n, "jdp.shard_map step")
        if DEVICE_AXIS not in self.mesh.axis_names:
            batch = _from_pmap_layout(batch)
        # Only a host batch can be a pmap-layout batch reshaped by hand.
        check_global_batch(batch, n, warn=not all(mesh_names(x) for x in jax.tree.leaves(batch)))
        step, axis_name = self.step, self.axis_name
        # Leaves a strategy placed per replica (a split optimizer state) are
        # split along the data axis and arrive as this device's (1, ...) row.
        rows = _layout.per_replica_leaves(state)
        treedef = _tree.structure(state)
        state_spec = treedef.unflatten(
            [PartitionSpec(axis_name) if r else PartitionSpec() for r in rows]
        )

        def per_replica(state, batch):
            local = treedef.flatten_up_to(state)
            state = treedef.unflatten([x[0] if r else x for x, r in zip(local, rows, strict=True)])
            out = step(state, batch)
            if not step.returns_state:  # evaluation: per-replica outputs only
                return jax.tree.map(lambda m: m[None], out)
            state, metrics = out
            local = treedef.flatten_up_to(state)
            state = treedef.unflatten(
                [x[None] if r else x for x, r in zip(local, rows, strict=True)]
            )
            return state, jax.tree.map(lambda m: m[None], metrics)

        # check_vma=False keeps pmap's semantics: the step's own psum/pmean is
        # the only gradient reduction (see docs/backends.md). Only the data axis
        # is manual: XLA partitions the step over any model axes.
        per_replica_spec = PartitionSpec(axis_name)
        mapped = jax.shard_map(
            per_replica,
            mesh=self.mesh,
            in_specs=(state_spec, PartitionSpec(axis_name)),
            out_specs=(state_spec, per_replica_spec) if step.returns_state else per_replica_spec,
            axis_names=frozenset({axis_name}),
            check_vma=False,
        )
        return mapped(state, batch)

    def _placement(self) -> _layout.Placement:
        return placement(self.layout, self.mesh, self._sharded, self._row_of)

    def shard(self, batch: PyTree) -> PyTree:
        """A global ``(B, ...)`` batch, sharded along its leading axis.

        ``batch`` is this process's part (the whole batch in a single
        process); the parts of all processes, in process order, form the
        global batch.
        """
        refuse_placed(batch, "jdp.ShardMapStep.shard", allowed=self._sharded)
        rows = {self._row_of(d) for d in self._sharded.addressable_devices}
        divisible_batch_size(batch, len(rows), "jdp.ShardMapStep.shard")
        if jax.process_count() == 1:  # the whole global batch is here: one device_put per leaf
            return jax.tree.map(lambda x: jax.device_put(x, self._sharded), batch)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._sharded, np.asarray(x)), batch
        )


class _ModelAxes:
    """A step's jit on a mesh with model axes: the state kept as placed, per-replica outputs apart.

    XLA's propagation is free to return a kernel split over ``model`` whole
    (it did for the test LM's kernels), so a training step fixes the new
    state's shardings to the old state's, one jit per placement. Per-replica
    outputs (metrics, evaluation sums) come out split over the data axis and
    copied over the model axes, where they would read as one replicated
    value: they are handed back on a 1-D mesh of each replica's first device
    (the same buffers, no copy), in the layout of a 1-D mesh's outputs.
    """

    def __init__(self, jitted: Callable[..., Compiled], rows: NamedSharding, keeps: bool):
        self._jitted, self._rows, self._keeps = jitted, rows, keeps
        self._free = jitted()  # under an outer jit, which places the outputs itself
        self._by_placement: dict[tuple, Compiled] = {}

    def _for(self, state: PyTree) -> Compiled:
        leaves, treedef = jax.tree.flatten(state)
        if not self._keeps or _traced(state) or not all(isinstance(x, jax.Array) for x in leaves):
            return self._free
        key = (treedef, *(x.sharding for x in leaves))
        if key not in self._by_placement:
            placed = jax.tree.unflatten(treedef, [x.sharding for x in leaves])
            self._by_placement[key] = self._jitted(out_shardings=(placed, None))
        return self._by_placement[key]

    def _per_replica(self, tree: PyTree) -> PyTree:
        devices = self._rows.device_set

        def one(x):
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                return x
            parts = [s.data for s in x.addressable_shards if s.device in devices]
            return jax.make_array_from_single_device_arrays(x.shape, self._rows, parts)

        return jax.tree.map(one, tree)

    def __call__(self, state: PyTree, batch: PyTree, *rest: Any) -> Any:
        out = self._for(state)(state, batch, *rest)
        if not self._keeps:
            return self._per_replica(out)
        new, metrics = out
        return new, self._per_replica(metrics)

    def lower(self, state: PyTree, batch: PyTree, *rest: Any) -> jax.stages.Lowered:
        return self._for(state).lower(state, batch, *rest)  # type: ignore[attr-defined]


def _from_pmap_layout(batch: PyTree) -> PyTree:
    """A pmap-layout batch (``jdp.shard``'s ``(n, B // n, ...)``) as the global batch.

    Told apart from a global batch of n examples by its mesh (the device-axis
    mesh of the pmap layout), inside the jit: merging the leading two axes of
    an array split along the first moves no data.
    """

    def one(x):
        if mesh_names(x) != (DEVICE_AXIS,) or x.ndim < 2:
            return x
        return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

    return jax.tree.map(one, batch)


@overload
def shard_map(  # type: ignore[overload-overlap]  # an EvalStep is callable too
    step: EvalStep,
    *,
    mesh: Mesh | None = ...,
    axis_name: str = ...,
    donate_state: bool | None = ...,
    devices: Sequence[jax.Device] | None = ...,
) -> ShardMapStep[EvalStep]: ...


@overload
def shard_map(
    step: TrainStep | Callable[[Any, PyTree], Any],
    *,
    mesh: Mesh | None = ...,
    axis_name: str = ...,
    donate_state: bool | None = ...,
    devices: Sequence[jax.Device] | None = ...,
) -> ShardMapStep[TrainStep]: ...


def shard_map(
    step: Step,
    *,
    mesh: Mesh | None = None,
    axis_name: str = AXIS_NAME,
    donate_state: bool | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> ShardMapStep[Any]:
    """Runs a per-replica step with ``jax.jit(jax.shard_map(...))`` over a mesh's data axis.

    The lead backend, in the layout JAX recommends: replicated global state,
    a globally sharded batch. :func:`jdp.pmap` runs the same step in the
    layout of ``jax.pmap``.

    Args:
      step: ``(state, batch) -> (state, metrics)``, e.g. from
        :func:`jdp.make_train_step`.
      mesh: a mesh with the axis ``axis_name`` (default: every device on a 1-D
        mesh). Its other axes, if any, are left to XLA: kernels the caller
        splits over them stay split (see docs/backends.md, "A mesh with
        model axes").
      axis_name: the data axis; must match the step's.
      donate_state: donate the input state's buffers to the output (default:
        True for training steps, False for evaluation steps).
      devices: instead of ``mesh``, the devices of a 1-D mesh (as
        :func:`jdp.pmap` takes them).

    Returns:
      A :class:`ShardMapStep`.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jdp
      >>> step = jdp.shard_map(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
      >>> state, metrics = step(state, step.shard(np.ones(16, np.float32)))
      >>> round(float(step.unreplicate(state).params), 4), metrics["loss"].shape
      (0.8, (8,))
    """
    if devices is not None:
        if mesh is not None:
            raise ValueError("jdp.shard_map: pass mesh= or devices=, not both.")
        devices = device_list(devices, "jdp.shard_map")
        mesh = Mesh(np.asarray(devices), (axis_name,))
    return ShardMapStep(step, mesh=mesh, axis_name=axis_name, donate_state=donate_state)

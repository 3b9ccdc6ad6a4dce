"""The pmap backend: state and batch carry a leading device axis."""

from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import _layout
from jdp._batching import (
    AXIS_NAME,
    DEVICE_AXIS,
    device_axis_sharding,
    device_list,
    local_mesh,
    shard_blocks,
)
from jdp._replication import placement
from jdp._steps import EvalStep, PerReplicaStep, TrainStep
from jdp._tree import PyTree
from jdp.backends._checks import check_pmap_inputs, mesh_names
from jdp.backends._runner import Backend, Compiled, K, Step


class PmapStep(Backend[K]):
    """A step in the pmap layout: state and batch carry a leading device axis.

    Built by :func:`jdp.pmap`. Call it as ``step(state, batch)``. In one
    process it runs as ``jax.jit`` of ``jax.shard_map`` over that layout (what
    ``jax.pmap`` is built on, without its per-call copies of a donated state);
    across processes it runs under ``jax.pmap``, each process feeding its own
    devices' rows. A state in the shard_map layout is re-placed on its first
    call, and a global batch from a ``jdp.shard_map`` step's ``shard`` is
    split into the leading axis inside the step (no copy).
    """

    name = "pmap"
    # recycles stays False: writing into a spare cost 1.34x the donating step on
    # the bench MLP (8 CPU devices; the layout's outputs do not alias it), and
    # a step that keeps its state costs 0.88x already (benchmarks/survivors.py).
    layout = _layout.LEADING_AXIS

    def __init__(
        self,
        step: Step,
        *,
        axis_name: str,
        donate_state: bool | None,
        devices: Sequence[jax.Device] | None,
    ):
        # devices=None maps over every process's devices; each process feeds
        # and receives arrays over its local ones.
        self.devices = jax.local_devices() if devices is None else device_list(devices, "jdp.pmap")
        self._all_devices = devices is None
        self._setup(step, axis_name, donate_state, len(self.devices))
        self._batch_sharding = device_axis_sharding(self.devices)
        # Checks of shapes run when the step is traced (once per input
        # structure); jax.pmap across processes sees only per-device shapes,
        # so there they run on every call.
        self._per_call_checks = jax.process_count() > 1
        self._build()

    def with_step(self, step: K) -> "PmapStep[K]":
        return PmapStep(
            step,
            axis_name=self.axis_name,
            donate_state=self.donates_state,
            devices=None if self._all_devices else self.devices,
        )

    def _replica_devices(self) -> list[jax.Device]:
        return list(jax.devices()) if self._all_devices else self.devices

    def _compile(self, options: bool) -> Compiled:
        if self._per_call_checks:
            if self.step.compiler_options is None:
                return jax.pmap(
                    self.step,
                    axis_name=self.axis_name,
                    devices=None if self._all_devices else self.devices,
                    donate_argnums=self._donate,
                )
            # The global arrays share the rows' buffers: nothing is donated.
            self._guard_donated = False
            return _AcrossProcesses(
                self.step, None if self._all_devices else self.devices, self.axis_name
            )
        mesh = Mesh(np.asarray(self.devices), (self.axis_name,))
        return _jit_pmap_layout(self.step, mesh, self._donate, self._batch_sharding, options)

    def _check_call(self, state: PyTree, batch: PyTree) -> None:
        if self._per_call_checks:
            check_pmap_inputs(state, batch, len(self.devices))

    def _placement(self) -> _layout.Placement:
        # pmap over every process's devices: the axis index is global.
        row_of = jax.devices().index if self._all_devices else self.devices.index
        n = jax.device_count() if self._all_devices else len(self.devices)
        place = placement(self.layout, local_mesh(self.devices), self._batch_sharding, row_of)
        return place._replace(size=n)

    def shard(self, batch: PyTree) -> PyTree:
        """``(B, ...)`` -> ``(n, B // n, ...)`` on the devices (see :func:`jdp.shard`)."""
        return shard_blocks(batch, self._batch_sharding, "jdp.PmapStep.shard")


@overload
def pmap(  # type: ignore[overload-overlap]  # an EvalStep is callable too
    step: EvalStep,
    *,
    axis_name: str = ...,
    donate_state: bool | None = ...,
    devices: Sequence[jax.Device] | None = ...,
) -> PmapStep[EvalStep]: ...


@overload
def pmap(
    step: TrainStep | Callable[[Any, PyTree], Any],
    *,
    axis_name: str = ...,
    donate_state: bool | None = ...,
    devices: Sequence[jax.Device] | None = ...,
) -> PmapStep[TrainStep]: ...


def pmap(
    step: Step,
    *,
    axis_name: str = AXIS_NAME,
    donate_state: bool | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> PmapStep[Any]:
    """Runs a per-replica step on every local device in the pmap layout.

    The compatibility backend: the layout of ``jax.pmap`` (a leading device
    axis on the state and the batch). :func:`jdp.shard_map` runs the same
    step in the layout JAX recommends.

    Args:
      step: ``(state, batch) -> (state, metrics)``, e.g. from
        :func:`jdp.make_train_step`.
      axis_name: the data axis; must match the step's.
      donate_state: donate the input state's buffers to the output, so the
        old state is consumed (calling a step with it again raises). Default:
        True for training steps, False for :func:`jdp.make_eval_step` steps.
      devices: default: every device of every process (each process passes
        arrays over its local devices).

    Returns:
      A :class:`PmapStep`: call it with a replicated state and a sharded batch.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jdp
      >>> step = jdp.pmap(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
      >>> state, metrics = step(state, step.shard(np.ones(8, np.float32)))
      >>> round(float(step.unreplicate(state).params), 4)
      0.8
    """
    return PmapStep(step, axis_name=axis_name, donate_state=donate_state, devices=devices)


def _from_global_batch(batch: PyTree, n: int) -> PyTree:
    """A global batch (a shard_map step's ``shard``) as the leading device axis, inside the jit.

    Told apart from a pmap-layout batch by its mesh: the pmap layout's arrays
    live on the device-axis mesh. The reshape splits the sharded axis into
    its blocks, so it moves no data.
    """

    def one(x):
        names = mesh_names(x)
        if not names or names == (DEVICE_AXIS,) or x.ndim == 0 or x.shape[0] % n:
            return x
        return x.reshape((n, x.shape[0] // n) + x.shape[1:])

    return jax.tree.map(one, batch)


def _jit_pmap_layout(
    step: PerReplicaStep,
    mesh: Mesh,
    donate: tuple[int, ...],
    layout: NamedSharding,
    options: bool = True,
    global_batches: bool = True,
) -> Callable[[PyTree, PyTree], Any]:
    """The pmap layout run by ``jax.jit`` + ``jax.shard_map`` in one process.

    Measured (MLP bench step, one CPU device): ``jax.pmap`` 0.88-0.90x of a
    plain jitted step (XLA copies the donated state, 18 copies per step),
    this path 0.98x. Shape checks run at trace time, so a call costs what a
    jitted call costs.
    """
    n = mesh.size

    def per_replica(state, batch):
        out = step(*jax.tree.map(lambda x: x[0], (state, batch)))
        return jax.tree.map(lambda x: x[None], out)

    spec = PartitionSpec(mesh.axis_names[0])
    mapped = jax.shard_map(per_replica, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)

    def run(state, batch):
        if global_batches:  # in one process, where a global batch can arrive
            batch = _from_global_batch(batch, n)
        check_pmap_inputs(state, batch, n)
        return mapped(state, batch)

    # Outputs keep jdp.replicate's sharding, so they read as the pmap layout.
    return jax.jit(
        run,
        donate_argnums=donate,
        out_shardings=layout,
        compiler_options=step.compiler_options if options else None,
    )


class _AcrossProcesses:
    """The pmap layout across processes as ``jax.jit`` of ``jax.shard_map``, with XLA options.

    For steps whose strategy needs compiler options (``jax.pmap`` takes
    none): each process's rows become one global array over every process's
    devices, process by process as ``jax.pmap`` orders them, and back. The
    state is not donated: the global arrays share the rows' buffers.
    """

    def __init__(self, step: PerReplicaStep, devices: Sequence[jax.Device] | None, axis_name: str):
        if devices is None:
            devices = [d for p in range(jax.process_count()) for d in jax.local_devices(p)]
        self._mesh = Mesh(np.asarray(devices), (axis_name,))
        self._spec = PartitionSpec(axis_name)
        self._jitted = _jit_pmap_layout(
            step, self._mesh, (), NamedSharding(self._mesh, self._spec), global_batches=False
        )

    def _global(self, state: PyTree, batch: PyTree) -> Any:
        return multihost_utils.host_local_array_to_global_array(
            (state, batch), self._mesh, self._spec
        )

    def __call__(self, state: PyTree, batch: PyTree) -> Any:
        out = self._jitted(*self._global(state, batch))
        return multihost_utils.global_array_to_host_local_array(out, self._mesh, self._spec)

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        return self._jitted.lower(*self._global(state, batch))  # type: ignore[attr-defined]

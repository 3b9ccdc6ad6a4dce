"""Backends: run one per-replica step over the local devices.

Both wrappers take the same per-replica step and return a callable with the
placement helpers of its layout, so a training script that uses them switches
backend by changing one line::

    train_step = jdp.pmap(step)        # or: jdp.shard_map(step)
    state = train_step.replicate(state)
    state, metrics = train_step(state, train_step.shard(batch))
    params = train_step.unreplicate(state).params
"""

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdp import _layout, _tree, _watchdog
from jdp._batching import (
    AXIS_NAME,
    divisible_batch_size,
    leaves_with_paths,
    local_mesh,
    refuse_placed,
    shard_blocks,
)
from jdp._devices import warn_if_cpu_pool_unsafe
from jdp._replication import place_rows, replicate, replicate_across, unreplicate
from jdp._state import TrainState
from jdp._steps import EvalStep, PerReplicaStep, TrainStep, as_step
from jdp._tree import PyTree
from jdp.distributed import check_initialized
from jdp.strategies import Placement

Step = TrainStep | EvalStep | Callable[[Any, PyTree], Any]


class Runner(Protocol):
    """A step wrapped by a backend: what :func:`jdp.fit` and :func:`jdp.evaluate` use."""

    step: PerReplicaStep

    def __call__(self, state: PyTree, batch: PyTree) -> Any: ...

    def replicate(self, tree: PyTree) -> PyTree: ...

    def unreplicate(self, tree: PyTree) -> PyTree: ...

    def shard(self, batch: PyTree) -> PyTree: ...


def _donation(step: PerReplicaStep, donate_state: bool | None, backend: str) -> tuple[int, ...]:
    """``donate_argnums``: the state, for steps that return a new one."""
    returns_state = step.returns_state
    if donate_state is None:
        donate_state = returns_state
    if donate_state and not returns_state:
        raise ValueError(
            f"jdp.{backend}(donate_state=True) on an evaluation step: it returns no state, "
            "so donating would delete the caller's state. Leave donate_state unset."
        )
    return (0,) if donate_state else ()


def _check_axis_name(step: PerReplicaStep, axis_name: str, backend: str) -> None:
    if step.axis_name != axis_name:
        step_axis = step.axis_name
        raise ValueError(
            f"The step was built with axis_name={step_axis!r} but jdp.{backend} "
            f"binds axis_name={axis_name!r}; pass the same name to both."
        )


class PmapStep:
    """A step in the pmap layout: state and batch carry a leading device axis.

    Built by :func:`jdp.pmap`. Call it as ``step(state, batch)``. In one
    process it runs as ``jax.jit`` of ``jax.shard_map`` over that layout (what
    ``jax.pmap`` is built on, without its per-call copies of a donated state);
    across processes it runs under ``jax.pmap``, each process feeding its own
    devices' rows.
    """

    def __init__(
        self,
        step: Step,
        *,
        axis_name: str,
        donate_state: bool | None,
        devices: Sequence[jax.Device] | None,
    ):
        step = as_step(step, "pmap", axis_name)
        _check_axis_name(step, axis_name, "pmap")
        check_initialized()
        self.step: PerReplicaStep = step
        self._has_options = step.compiler_options is not None
        # devices=None maps over every process's devices; each process feeds
        # and receives arrays over its local ones.
        self.devices = list(devices) if devices is not None else jax.local_devices()
        self._all_devices = devices is None
        self.axis_name = axis_name
        self._batch_sharding = NamedSharding(local_mesh(self.devices), PartitionSpec(AXIS_NAME))
        donate = _donation(step, donate_state, "pmap")
        n = len(self.devices)
        # Checks of shapes run when the step is traced (once per input
        # structure); jax.pmap across processes sees only per-device shapes,
        # so there they run on every call.
        self._per_call_checks = jax.process_count() > 1
        if self._per_call_checks:
            if step.compiler_options is None:
                self._fn = jax.pmap(
                    step,
                    axis_name=axis_name,
                    devices=None if devices is None else self.devices,
                    donate_argnums=donate,
                )
            else:
                self._fn = _AcrossProcesses(step, devices, axis_name)
                donate = ()
            self._fn_traced = self._fn
        else:
            mesh = Mesh(np.asarray(self.devices), (axis_name,))
            self._fn = _jit_pmap_layout(step, mesh, donate, self._batch_sharding)
            # Under an outer jit, which takes the options itself (a nested jit cannot).
            self._fn_traced = self._fn
            if self._has_options:
                self._fn_traced = _jit_pmap_layout(
                    step, mesh, donate, self._batch_sharding, options=False
                )
        # Reusing donated buffers crashes multi-device executions on XLA:CPU
        # (JAX 0.10.2: segfault); one device raises, and _call explains it.
        self._guard_donated = bool(donate) and n > 1
        warn_if_cpu_pool_unsafe(n)

    def __call__(self, state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
        if self._per_call_checks:
            _check_pmap_inputs(state, batch, len(self.devices))
        fn = self._fn
        if self._has_options and _traced(state):
            _warn_options_lost(self.step)
            fn = self._fn_traced
        return _call(fn, state, batch, self.axis_name, "pmap", self._guard_donated)

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for these arguments (``.compile()``, ``.as_text()``)."""
        return self._fn.lower(state, batch)

    def replicate(self, tree: PyTree) -> PyTree:
        """One copy per device with a leading device axis (see :func:`jdp.replicate`).

        A TrainState is placed as the step's strategy says (e.g. zero1 splits
        the optimizer state: row i of each split leaf on device i).
        """
        if self._all_devices:  # pmap over every process's devices: the axis index is global
            n, row_of = jax.device_count(), jax.devices().index
        else:
            n, row_of = len(self.devices), self.devices.index
        placement = Placement(
            partial(replicate, devices=self.devices),
            partial(place_rows, sharding=self._batch_sharding, row_of=row_of),
            n,
        )
        return self.step.place(tree, placement)

    def unreplicate(self, tree: PyTree) -> PyTree:
        """Replica 0's values, a split optimizer state whole (see :func:`jdp.unreplicate`)."""
        return unreplicate(tree)

    def shard(self, batch: PyTree) -> PyTree:
        """``(B, ...)`` -> ``(n, B // n, ...)`` on the devices (see :func:`jdp.shard`)."""
        return shard_blocks(batch, self._batch_sharding)


class ShardMapStep:
    """A step run by ``jax.jit(jax.shard_map(...))`` over a 1-D device mesh.

    State is held once, as global arrays replicated across the mesh (no
    leading device axis); the batch is a global ``(B, ...)`` array sharded
    along its leading axis. Per-replica metrics keep a leading axis of size n,
    as under pmap. Built by :func:`jdp.shard_map`.
    """

    def __init__(self, step: Step, *, mesh: Mesh | None, axis_name: str, donate_state: bool | None):
        step = as_step(step, "shard_map", axis_name)
        _check_axis_name(step, axis_name, "shard_map")
        check_initialized()
        self.step: PerReplicaStep = step
        self._has_options = step.compiler_options is not None
        if mesh is None:
            mesh = Mesh(np.asarray(jax.devices()), (axis_name,))
        if mesh.axis_names != (axis_name,):
            raise ValueError(
                f"jdp.shard_map needs a 1-D mesh with the axis {axis_name!r}, got "
                f"axes {mesh.axis_names}; e.g. jax.make_mesh((n,), ({axis_name!r},))."
            )
        self.mesh = mesh
        self.axis_name = axis_name
        self._sharded = NamedSharding(mesh, PartitionSpec(axis_name))
        donate = _donation(step, donate_state, "shard_map")
        self._fn = jax.jit(self._run, donate_argnums=donate, compiler_options=step.compiler_options)
        # Under an outer jit, which takes the options itself (a nested jit cannot).
        self._fn_traced = (
            jax.jit(self._run, donate_argnums=donate) if self._has_options else self._fn
        )
        self._guard_donated = bool(donate) and mesh.size > 1
        warn_if_cpu_pool_unsafe(mesh.size)

    def __call__(self, state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
        fn = self._fn
        if self._has_options and _traced(state):
            _warn_options_lost(self.step)
            fn = self._fn_traced
        return _call(fn, state, batch, self.axis_name, "shard_map", self._guard_donated)

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for these arguments (``.compile()``, ``.as_text()``)."""
        return self._fn.lower(state, batch)

    def _run(self, state: PyTree, batch: PyTree) -> PyTree:
        """Traced once per input structure: the checks, then the mapped step."""
        n = self.mesh.size
        _check_state(state, n, expected_ndim=0, layout="shard_map")
        _check_global_batch(batch, n)
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
        # the only gradient reduction (see docs/backends.md).
        per_replica_spec = PartitionSpec(axis_name)
        mapped = jax.shard_map(
            per_replica,
            mesh=self.mesh,
            in_specs=(state_spec, PartitionSpec(axis_name)),
            out_specs=(state_spec, per_replica_spec) if step.returns_state else per_replica_spec,
            check_vma=False,
        )
        return mapped(state, batch)

    def replicate(self, tree: PyTree) -> PyTree:
        """One global copy of ``tree``, replicated across the mesh (never aliased).

        A TrainState is placed as the step's strategy says (e.g. zero1 splits
        the optimizer state: split leaves are ``(n, ...)`` arrays, row i on the
        mesh's device i).
        """
        devices = list(self.mesh.devices.flat)
        placement = Placement(
            partial(replicate_across, mesh=self.mesh),
            partial(place_rows, sharding=self._sharded, row_of=devices.index),
            self.mesh.size,
        )
        return self.step.place(tree, placement)

    def unreplicate(self, tree: PyTree) -> PyTree:
        """The local copy of replicated state, a split optimizer state whole."""
        return unreplicate(tree)

    def shard(self, batch: PyTree) -> PyTree:
        """A global ``(B, ...)`` batch, sharded along its leading axis.

        ``batch`` is this process's part (the whole batch in a single
        process); the parts of all processes, in process order, form the
        global batch.
        """
        refuse_placed(batch, "ShardMapStep.shard", allowed=self._sharded)
        divisible_batch_size(batch, len(self._sharded.addressable_devices))
        if jax.process_count() == 1:  # the whole global batch is here: one device_put per leaf
            return jax.tree.map(lambda x: jax.device_put(x, self._sharded), batch)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._sharded, np.asarray(x)), batch
        )


def pmap(
    step: Step,
    *,
    axis_name: str = AXIS_NAME,
    donate_state: bool | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> PmapStep:
    """Runs a per-replica step on every local device with ``jax.pmap``.

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


def shard_map(
    step: Step,
    *,
    mesh: Mesh | None = None,
    axis_name: str = AXIS_NAME,
    donate_state: bool | None = None,
) -> ShardMapStep:
    """Runs a per-replica step with ``jax.jit(jax.shard_map(...))`` on a 1-D mesh.

    The same step as under :func:`jdp.pmap`, with the layout modern JAX
    recommends: replicated global state, a globally sharded batch.

    Args:
      step: ``(state, batch) -> (state, metrics)``, e.g. from
        :func:`jdp.make_train_step`.
      mesh: a 1-D mesh with the axis ``axis_name`` (default: every device).
      axis_name: the data axis; must match the step's.
      donate_state: donate the input state's buffers to the output (default:
        True for training steps, False for evaluation steps).

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
    return ShardMapStep(step, mesh=mesh, axis_name=axis_name, donate_state=donate_state)


def _jit_pmap_layout(
    step: PerReplicaStep,
    mesh: Mesh,
    donate: tuple[int, ...],
    layout: NamedSharding,
    options: bool = True,
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
        _check_pmap_inputs(state, batch, n)
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
        self._jitted = _jit_pmap_layout(step, self._mesh, (), NamedSharding(self._mesh, self._spec))

    def _global(self, state: PyTree, batch: PyTree) -> Any:
        return multihost_utils.host_local_array_to_global_array(
            (state, batch), self._mesh, self._spec
        )

    def __call__(self, state: PyTree, batch: PyTree) -> Any:
        out = self._jitted(*self._global(state, batch))
        return multihost_utils.global_array_to_host_local_array(out, self._mesh, self._spec)

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        return self._jitted.lower(*self._global(state, batch))  # type: ignore[attr-defined]


def _check_pmap_inputs(state: PyTree, batch: PyTree, n: int) -> None:
    _check_state(state, n, expected_ndim=1, layout="pmap")
    if not _leading_axes_ok(batch, lambda size: size == n):
        _explain_leading(batch, n)


def _check_global_batch(batch: PyTree, n: int) -> None:
    if not _leading_axes_ok(batch, lambda size: size % n == 0):
        divisible_batch_size(batch, n)  # raises, naming the leaf
    if n > 1 and _leading_axes_ok(batch, lambda s: s == n):
        warnings.warn(
            f"Every batch leaf has a leading axis of {n}, the device count: one example "
            "per device, or a pmap-layout batch (n, B // n, ...) from jdp.shard? "
            "jdp.shard_map expects the global (B, ...) batch: use step.shard(batch).",
            UserWarning,
            stacklevel=2,
        )


def _traced(state: PyTree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state))


def _warn_options_lost(step: PerReplicaStep) -> None:
    """An outer transform (jax.jit) compiles the step: the strategy's options are that jit's to pass."""
    name = step.strategy.name if isinstance(step, TrainStep) else type(step).__name__
    warnings.warn(
        f"This jdp step's strategy ({name}) needs XLA options that jdp passes "
        "when it compiles the step, but an outer transform (jax.jit) is compiling it here; "
        "without them the result may differ by device count. Pass them to your jit (then "
        f"this warning is all that is left): jax.jit(f, compiler_options={step.compiler_options!r}).",
        stacklevel=3,
    )


def _call(fn, state: PyTree, batch: PyTree, axis_name: str, backend: str, guard: bool):
    """Runs the compiled step; a consumed state or an unknown axis gets jdp's own error.

    Everything here but the call itself runs only when the call failed.
    """
    _watchdog.note_step()
    if guard and _consumed(state):
        raise RuntimeError(_CONSUMED)
    try:
        return fn(state, batch)
    except (ValueError, TypeError, IndexError) as e:
        if _mapped_by_a_transform(e, state, batch):
            raise TypeError(
                f"A jdp.{backend} step was called under jax.vmap or jax.pmap (or another "
                "transform that maps over the inputs): it is mapped over the devices already. "
                "Call it directly; to map the step yourself, map the per-replica step "
                "(jax.pmap(jdp.make_train_step(...), axis_name=...)); to add work inside the "
                "step, wrap it with @jdp.wraps(train_step)."
            ) from e
        if isinstance(e, ValueError) and "deleted or donated" in str(e) and _consumed(state):
            raise RuntimeError(_CONSUMED) from None
        if isinstance(e, TypeError) and "Error interpreting argument" in str(e):
            leaves_with_paths(batch, "batch")  # jdp's own message, naming the leaf
            leaves_with_paths(state, "state")
        raise
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise
        raise NameError(
            f"The step uses a collective over an axis jdp.{backend} does not bind: {e}. "
            f"This backend binds axis_name={axis_name!r}; use that name in lax.psum/pmean "
            "calls inside the step (and in make_train_step(axis_name=...))."
        ) from None


def _mapped_by_a_transform(error: Exception, *trees: PyTree) -> bool:
    """Inputs traced by a transform that maps them (vmap, pmap): they lost their leading axis.

    ``jax.jit`` around a step composes (its tracers keep their shapes); under
    ``jax.pmap`` the tracers look like jit's, so the layout error they cause tells.
    """
    tracers = [x for x in jax.tree.leaves(trees) if isinstance(x, jax.core.Tracer)]
    if any(type(x).__name__ == "BatchTracer" for x in tracers):
        return True
    layout = isinstance(error, IndexError) or any(
        phrase in str(error) for phrase in ("is not replicated", "expects a leading device axis")
    )
    return bool(tracers) and layout


_CONSUMED = (
    "This state was consumed by an earlier step call: steps donate their input "
    "state's buffers to the new state (jdp.pmap/jdp.shard_map donate_state). Use "
    "the state the step returned (state, metrics = step(state, batch)); after "
    "re-running a notebook cell, re-create or restore the state."
)


def _consumed(state: PyTree) -> bool:
    return any(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
        for x in jax.tree.leaves(state)
    )


def _check_state(state: PyTree, n: int, *, expected_ndim: int, layout: str) -> None:
    if not isinstance(state, TrainState):
        return
    ndim = np.ndim(state.step)
    if ndim == expected_ndim and (layout != "pmap" or state.step.shape[0] == n):
        return
    if layout == "pmap" and ndim == 1:
        raise ValueError(
            f"The state is replicated for {state.step.shape[0]} devices but this "
            f"step runs on {n}. Re-place it: state = step.replicate(step.unreplicate(state))."
        )
    if layout == "pmap":
        raise ValueError(
            "The state is not replicated: state.step has shape "
            f"{np.shape(state.step)}, expected ({n},). Call state = step.replicate(state) "
            "(or jdp.replicate(state)) before the first step."
        )
    raise ValueError(
        "jdp.shard_map expects the state as global replicated arrays (state.step "
        f"of shape ()), got state.step of shape {np.shape(state.step)}. Use "
        "state = step.replicate(state) on an unreplicated state."
    )


def _leading_axes_ok(batch: PyTree, ok: Callable[[int], bool]) -> bool:
    """The per-step check: cheap; leaf paths are only built to explain a failure."""
    return all(
        hasattr(leaf, "shape") and leaf.shape and ok(leaf.shape[0])
        for leaf in jax.tree.leaves(batch)
    )


def _explain_leading(batch: PyTree, n: int) -> None:
    for name, leaf in leaves_with_paths(batch, "batch"):
        if not leaf.shape or leaf.shape[0] != n:
            raise ValueError(
                f"Batch leaf {name} has shape {leaf.shape}, but a pmap step on {n} "
                f"devices expects a leading device axis of {n}: pass "
                "step.shard(batch) (or jdp.shard(batch))."
            )

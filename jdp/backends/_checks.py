"""Trace-time checks of a backend's inputs: the state's layout and the batch's shape."""

import warnings
from collections.abc import Callable

import jax
import numpy as np

from jdp import _layout
from jdp._batching import divisible_batch_size, leaves_with_paths
from jdp._state import TrainState
from jdp._tree import PyTree


def check_pmap_inputs(state: PyTree, batch: PyTree, n: int) -> None:
    check_state(state, n, _layout.LEADING_AXIS, "jdp.pmap step")
    if not _leading_axes_ok(batch, lambda size: size == n):
        _explain_leading(batch, n)


def check_global_batch(batch: PyTree, n: int, warn: bool) -> None:
    if not _leading_axes_ok(batch, lambda size: size % n == 0):
        divisible_batch_size(batch, n, "jdp.shard_map step")  # raises, naming the leaf
    if warn and n > 1 and _leading_axes_ok(batch, lambda s: s == n):
        warnings.warn(
            f"Every batch leaf has a leading axis of {n}, the device count: one example "
            "per device, or a pmap-layout batch (n, B // n, ...) reshaped on the host? "
            "jdp.shard_map expects the global (B, ...) batch: use step.shard(batch).",
            UserWarning,
            stacklevel=2,
        )


def check_state(state: PyTree, n: int, layout: _layout.Layout, what: str) -> None:
    """A TrainState's step counter says which layout it is in (works on tracers)."""
    if not isinstance(state, TrainState):
        return
    ndim = np.ndim(state.step)
    if layout is _layout.LEADING_AXIS:
        if ndim == 1 and state.step.shape[0] == n:
            return
        if ndim == 1:
            raise ValueError(
                f"{what}: the state is replicated for {state.step.shape[0]} devices but this "
                f"step runs on {n}. Re-place it: state = step.replicate(step.unreplicate(state))."
            )
        raise ValueError(
            f"{what}: the state is not replicated: state.step has shape "
            f"{np.shape(state.step)}, expected ({n},). Call state = step.replicate(state) "
            "before the first step."
        )
    if ndim == 0:
        return
    raise ValueError(
        f"{what}: jdp.shard_map expects the state as global replicated arrays (state.step "
        f"of shape ()), got state.step of shape {np.shape(state.step)}. Use "
        "state = step.replicate(state) on an unreplicated state."
    )


def check_per_replica_rows(state: PyTree, n: int, what: str) -> None:
    """Leaves a strategy placed per replica have one row per device of this step."""
    rows = _layout.per_replica_leaves(state)
    for leaf, per_replica in zip(jax.tree.leaves(state), rows, strict=True):
        if per_replica and np.shape(leaf)[:1] != (n,):
            raise ValueError(
                f"{what}: the state's strategy split it over {np.shape(leaf)[0]} devices but this "
                f"step runs on {n}. Re-place it: state = step.replicate(step.unreplicate(state))."
            )


def _leading_axes_ok(batch: PyTree, ok: Callable[[int], bool]) -> bool:
    """The per-step check: cheap; leaf paths are only built to explain a failure."""
    return all(
        hasattr(leaf, "shape") and leaf.shape and ok(leaf.shape[0])
        for leaf in jax.tree.leaves(batch)
    )


def _explain_leading(batch: PyTree, n: int) -> None:
    for name, leaf in leaves_with_paths(batch, "jdp.pmap step: the batch"):
        if not leaf.shape or leaf.shape[0] != n:
            raise ValueError(
                f"jdp.pmap step: batch leaf {name} has shape {leaf.shape}, but a pmap step on {n} "
                f"devices expects a leading device axis of {n}: pass "
                "step.shard(batch) (or jdp.shard(batch))."
            )


def mesh_names(x) -> tuple:
    """The axis names of the mesh a traced input was placed on (() for a host array)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return tuple(getattr(mesh, "axis_names", ()))

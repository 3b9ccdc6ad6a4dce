"""Weight-update sharding (Xu et al. 2020; ZeRO stage 1): 1/n of the optimizer per replica.

``make_train_step(..., strategy=jdp.strategies.zero1())`` keeps data-parallel semantics
but gives each replica one slice of every parameter leaf's optimizer state
and of the update work. Each parameter leaf with at least n elements is
flattened, zero-padded to a multiple of n and cut into n equal slices of
shape ``(1, ..., 1, c)`` (the leaf's rank is kept, so masks such as
``lambda p: p.ndim > 1`` still select the same leaves); smaller leaves stay
whole on every replica. The step reduce-scatters the gradients
(``lax.psum_scatter``), runs ``tx.update`` on its slices and all-gathers the
new parameters, which stay replicated: the same bytes moved as one
all-reduce.

This is exact for transforms that treat every element on its own (sgd,
momentum, Adam, AdamW, Lion, schedules, masks). A transform that reduces over
a leaf or over the tree (global-norm clipping, adafactor's factored moments,
LAMB/LARS trust ratios) would see only a slice: the step refuses it when it is
first traced, naming the reduction; :func:`clip_by_global_norm` is the exact
global-norm clip here too: the update passes it the norm over every replica's
slices as optax's extra argument ``global_norm``.

The placed optimizer state is a :class:`ShardedOptState`: leaves of shape
``(n, 1, ..., 1, c)``, row i on device i, in both backends. Checkpoints,
``step.unreplicate`` and ``jdp.unreplicate`` hold the logical layout, the one
``tx.init(params)`` returns.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdp import _layout, _tree
from jdp._forward import Forward
from jdp._layout import Placement
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp._update import apply_gradients
from jdp._weighting import safe_divide
from jdp.distributed import from_process0
from jdp.strategies._base import (
    PSUM,
    Communication,
    NormFn,
    Reduced,
    Strategy,
    check_communication,
    refuse_per_replica,
)
from jdp.strategies._data_parallel import check_reduce, local_contribution, reduced
from jdp.strategies._elementwise import check_elementwise
from jdp.strategies._slices import (
    PerLayer,
    Record,
    _rows,
    is_sharded_param,
    is_split_per_layer,
    join_rows,
    record_slice_shape,
    slice_shape,
    split_rows,
    whole_shape,
)


def zero1(
    *,
    reduce: Literal["mean", "sum"] = "mean",
    accumulate_steps: int = 1,
    communication: Communication = PSUM,
) -> Strategy:
    """Weight-update sharding (ZeRO-1): each replica holds and updates 1/n of the optimizer.

    Gradients are reduce-scattered, each replica runs ``tx.update`` on its
    slices and the new parameters are all-gathered (``docs/memory.md``): the
    same update as :func:`data_parallel` for elementwise optimizers; a
    transform that reduces over a slice is refused when the step is first
    traced. Place the state with the wrapped step's ``replicate``.

    Args:
      reduce: as for :func:`data_parallel`.
      accumulate_steps: as for :func:`data_parallel`.
      communication: the collectives gradients cross with.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> step = jdp.pmap(jdp.make_train_step(lambda p, b: jnp.mean((b @ p) ** 2),
      ...                                     strategy=jdp.strategies.zero1()))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(16), tx=optax.adam(0.1)))
      >>> type(state.opt_state).__name__, state.opt_state.num_shards
      ('ShardedOptState', 8)
    """
    check_reduce(reduce, accumulate_steps, communication, "jdp.strategies.zero1")

    def gradients(forward: Forward, state: TrainState, batch: PyTree, axis_name: str) -> Reduced:
        refuse_per_replica(state, "zero1", "params")
        check_communication(communication, state, "zero1")
        local = local_contribution(forward, state, batch, axis_name, accumulate_steps)
        grads = reduce_scatter_gradients(
            local.grads, axis_name, reduce, local.weight, communication
        )
        n = lax.axis_size(axis_name)
        split = [is_sharded_param(x.shape, n) for x in jax.tree.leaves(local.grads)]
        return reduced(local, grads, axis_name, split)

    return Strategy("zero1", gradients, apply_sharded, sharded_norm, place)


@_tree.dataclass
class ShardedOptState:
    """The optimizer state of a :func:`zero1` step, 1/n per device.

    A :class:`jdp._layout.PerReplica` node: ``jdp.unreplicate`` and
    checkpoints read it in its logical layout (``tx.init(params)``), and a
    checkpoint restores into it on any device count.

    Attributes:
      shards: ``tx.init`` of the parameter slices. Placed, a sharded leaf has
        shape ``(n, 1, ..., 1, c)``, row i on device i; other leaves (counts,
        the state of small parameters) are replicated like the rest of the
        state.
      logical_shapes: per leaf of ``shards``, the shape in ``tx.init(params)``
        when the leaf is sharded (a :class:`PerLayer` of it when it is cut
        layer by layer, under ``fsdp(stacked=...)``), else None.
      num_shards: n, the devices of the data axis.
    """

    shards: PyTree
    logical_shapes: tuple = _tree.static_field()
    num_shards: int = _tree.static_field()

    def logical(self, read: Callable[[Any], Any]) -> PyTree:
        """The ``tx.init(params)`` layout on the host; replicated leaves through ``read``."""
        leaves, treedef = _tree.flatten(self.shards)
        out = []
        for x, shape in zip(leaves, self.logical_shapes, strict=True):
            if shape is None:
                out.append(read(x))
                continue
            out.append(join_rows(all_rows(x) if isinstance(x, jax.Array) else x, shape))
        return jax.tree.unflatten(treedef, out)

    def shared(self) -> PyTree:
        """The leaves every replica holds alike (split leaves left out)."""
        leaves, treedef = _tree.flatten(self.shards)
        kept = [None if shape else x for x, shape in zip(leaves, self.logical_shapes, strict=True)]
        return jax.tree.unflatten(treedef, kept)

    def place_like(self, value: PyTree, replicate: Callable[[PyTree], PyTree]) -> "ShardedOptState":
        """A logical optimizer state split and placed as this one is, leaf by leaf.

        Each leaf's rows are placed as its own are: on a mesh with model axes
        a row may also be split over them.
        """
        n = self.num_shards
        mine = [
            _layout.rows_like(x, n) if shape else None
            for x, shape in zip(jax.tree.leaves(self.shards), self.logical_shapes, strict=True)
        ]
        placement = Placement(replicate, next(r for r in mine if r is not None), n)
        split = _split(value, self.logical_shapes, placement, mine)
        return type(self)(split.shards, split.logical_shapes, split.num_shards)


def param_slices(params: PyTree, index: jax.Array, n: int) -> PyTree:
    """This replica's slice of every split leaf; small leaves whole."""

    def one(x):
        if not is_sharded_param(x.shape, n):
            return x
        return lax.dynamic_index_in_dim(_rows(x, n), index, keepdims=False).reshape(
            slice_shape(x.shape, n)
        )

    return jax.tree.map(one, params)


def param_records(params: PyTree, n: int, per_layer: Sequence[bool] | None = None) -> tuple:
    """Each parameter leaf's record: None (whole), its shape, or a :class:`PerLayer`.

    ``per_layer``: per leaf, whether it is stacked over layers (cut layer by
    layer where each layer has at least n elements, else kept whole).
    """
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    stacked = per_layer if per_layer is not None else [False] * len(shapes)
    records: list[Record | None] = []
    for shape, layered in zip(shapes, stacked, strict=True):
        if layered:
            records.append(PerLayer(shape) if is_split_per_layer(shape, n) else None)
        else:
            records.append(shape if is_sharded_param(shape, n) else None)
    return tuple(records)


def slice_template(
    params: PyTree, n: int, records: Sequence[Record | None] | None = None
) -> PyTree:
    """Shape/dtype structs of one replica's parameter slices (``records``: :func:`param_records`)."""
    leaves, treedef = _tree.flatten(params)
    records = records if records is not None else param_records(params, n)
    structs = [
        jax.ShapeDtypeStruct(x.shape if r is None else record_slice_shape(r, n), x.dtype)
        for x, r in zip(leaves, records, strict=True)
    ]
    return jax.tree.unflatten(treedef, structs)


def layout(
    tx: optax.GradientTransformation,
    params: PyTree,
    n: int,
    records: Sequence[Record | None] | None = None,
) -> tuple:
    """``logical_shapes`` for ``tx`` on ``params`` split n ways (as ``records`` cut the params).

    Raises:
      ValueError: the transform keeps state whose shape is not the parameter's
        (e.g. adafactor's factored moments), which a slice cannot hold exactly.
    """
    logical = jax.eval_shape(tx.init, params)
    sliced = jax.eval_shape(tx.init, slice_template(params, n, records))
    if _tree.structure(logical) != _tree.structure(sliced):
        raise ValueError(
            "jdp.strategies.zero1: the optimizer's state has another structure for parameter "
            "slices than for whole parameters, so it cannot be split exactly. Use an "
            "elementwise optimizer (sgd, momentum, adam, adamw, lion) or "
            "jdp.strategies.data_parallel()."
        )
    shapes: list[Record | None] = []
    paths = jax.tree_util.tree_flatten_with_path(logical)[0]
    for (path, whole), part in zip(paths, jax.tree.leaves(sliced), strict=True):
        if whole.shape == part.shape:
            shapes.append(None)
        elif part.shape == slice_shape(whole.shape, n):
            shapes.append(tuple(whole.shape))
        elif part.shape == record_slice_shape(PerLayer(tuple(whole.shape)), n):
            shapes.append(PerLayer(tuple(whole.shape)))
        else:
            raise ValueError(
                f"jdp.strategies.zero1: optimizer state leaf {jax.tree_util.keystr(path)} has "
                f"shape {whole.shape} for the whole parameters but {part.shape} for a slice "
                "(expected the slice's own shape): the transform keeps per-leaf statistics "
                "that are not elementwise (e.g. adafactor's factored moments). Use an "
                "elementwise optimizer or jdp.strategies.data_parallel()."
            )
    return tuple(shapes)


def _check_layout(opt_state: PyTree, shapes: tuple) -> None:
    count = len(jax.tree.leaves(opt_state))
    if count != len(shapes):
        raise ValueError(
            "jdp.strategies.zero1: state.opt_state does not match state.tx.init(state.params) "
            f"({count} leaves, expected {len(shapes)}); build the state with "
            "jdp.TrainState.create(params=..., tx=...)."
        )
    for x, shape in zip(jax.tree.leaves(opt_state), shapes, strict=True):
        if shape is not None and tuple(np.shape(x)) != whole_shape(shape):
            raise ValueError(
                f"jdp.strategies.zero1: an optimizer state leaf has shape {np.shape(x)}, expected "
                f"{whole_shape(shape)} "
                "(the logical layout of tx.init(params)). Was it placed already? Pass the "
                "state as TrainState.create returns it."
            )


def _split(
    opt_state: PyTree,
    shapes: tuple,
    placement: Placement,
    rows: Sequence[Callable[[Any], jax.Array] | None] | None = None,
) -> ShardedOptState:
    """A logical optimizer state cut into n rows per split leaf, placed.

    ``rows``: per leaf, how to place its rows (default ``placement.rows``).
    """
    _check_layout(opt_state, shapes)
    n = placement.size
    leaves, treedef = _tree.flatten(opt_state)
    holes = [None if shape else x for x, shape in zip(leaves, shapes, strict=True)]
    kept = jax.tree.leaves(
        placement.replicate(jax.tree.unflatten(treedef, holes)), is_leaf=lambda x: x is None
    )
    placers = rows if rows is not None else [None] * len(leaves)
    out = [
        (place or placement.rows)(np.asarray(split_rows(jnp.asarray(x), shape, n))) if shape else k
        for x, k, shape, place in zip(leaves, kept, shapes, placers, strict=True)
    ]
    return ShardedOptState(jax.tree.unflatten(treedef, out), shapes, n)


def place(state: TrainState, placement: Placement) -> TrainState:
    """A whole TrainState placed for a zero1 step: optimizer state split, the rest replicated.

    With several processes, process 0's values are used everywhere, as by
    ``jdp.replicate``.
    """
    if isinstance(state.opt_state, ShardedOptState):
        raise ValueError(
            "jdp.strategies.zero1: replicate got a state whose optimizer state is already split over devices; pass the "
            "whole state (step.unreplicate(state)) to place it again."
        )
    state = from_process0(state)
    shapes = layout(state.tx, state.params, placement.size)
    opt_state = _split(state.opt_state, shapes, placement)
    return placement.replicate(state.replace(opt_state=None)).replace(opt_state=opt_state)


def reduce_scatter_gradients(
    grads: PyTree,
    axis_name: str,
    grad_reduce: str,
    weight: jax.Array | None,
    communication: Communication = PSUM,
) -> PyTree:
    """:func:`jdp.reduce_gradients`, but each replica keeps only its slices.

    Split leaves are reduce-scattered; small leaves are all-reduced whole.
    The arithmetic is reduce_gradients' own.
    """
    n = lax.axis_size(axis_name)
    if weight is not None and grad_reduce == "sum":  # per-replica weighted means, summed
        grads = jax.tree.map(lambda g: safe_divide(g, weight.astype(g.dtype)), grads)
    leaves, treedef = _tree.flatten(grads)
    split = [is_sharded_param(x.shape, n) for x in leaves]
    small = communication.all_reduce(
        [x for x, s in zip(leaves, split, strict=True) if not s], axis_name
    )
    rows = [_rows(x, n) for x, s in zip(leaves, split, strict=True) if s]
    parts = communication.reduce_scatter(rows, axis_name)
    like = iter([x for x, s in zip(leaves, split, strict=True) if s])
    scattered = iter([p.reshape(slice_shape(next(like).shape, n)) for p in parts])
    summed = iter(small)
    out = [next(scattered) if s else next(summed) for s in split]
    if weight is not None and grad_reduce == "mean":
        total = lax.psum(weight, axis_name)
        out = [safe_divide(g, total.astype(g.dtype)) for g in out]
    elif grad_reduce == "mean":
        out = [g / n for g in out]  # lax.pmean's arithmetic: the sum, divided by n
    return jax.tree.unflatten(treedef, out)


def gather_params(slices: PyTree, like: PyTree, axis_name: str) -> PyTree:
    """Whole parameters from every replica's slices (one ``all_gather`` per split leaf)."""
    n = lax.axis_size(axis_name)

    def one(part, whole):
        if not is_sharded_param(whole.shape, n):
            return part
        flat = lax.all_gather(part.reshape(-1), axis_name, tiled=True)
        return flat[: whole.size].reshape(whole.shape)

    return jax.tree.map(one, slices, like)


def sharded_norm(tree: PyTree, params: PyTree, axis_name: str) -> jax.Array:
    """The global L2 norm of a tree of this replica's slices (and whole small leaves).

    Each replica sums the squares of its slices; one scalar ``psum`` adds
    them up. Leaves held whole count once.
    """
    n = lax.axis_size(axis_name)
    split = [is_sharded_param(x.shape, n) for x in jax.tree.leaves(params)]
    leaves = jax.tree.leaves(tree)
    if len(split) != len(leaves):
        raise ValueError(
            "jdp.clip_by_global_norm under zero1 expects a tree shaped like the parameters "
            f"({len(split)} leaves), got {len(leaves)}."
        )
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves]
    parts = [q for q, s in zip(squares, split, strict=True) if s]
    whole = [q for q, s in zip(squares, split, strict=True) if not s]
    total = lax.psum(sum(parts, jnp.float32(0)), axis_name) + sum(whole, jnp.float32(0))
    return jnp.sqrt(total)


def gathered_norm(tree: PyTree, params: PyTree, axis_name: str) -> jax.Array:
    """The global L2 norm of a tree of slices, computed on the whole tree.

    The slices are all-gathered and reduced as :func:`optax.tree.norm`
    reduces the unsharded tree (the same shapes, the same order), so exact
    mode's clip reads the same bits on any device count; :func:`sharded_norm`'s
    ``psum`` adds the replicas' partial sums in an order that depends on n.
    """
    # The barrier keeps each leaf whole: without it XLA folds the gather's
    # reshapes into the reduction, which then sums a (size,) array instead of
    # the leaf's shape, in another order (1 ulp off the unsharded clip).
    return optax.tree.norm(lax.optimization_barrier(gather_params(tree, params, axis_name)))


def check_sharded(sharded: object, n: int, name: str) -> None:
    """The state holds a value split by a sharded strategy, ``n`` ways."""
    if not isinstance(sharded, ShardedOptState):
        raise TypeError(
            f"jdp.strategies.{name}: the step needs the state split over the devices, got "
            f"a {type(sharded).__name__}. Place the state with the wrapped step: state = "
            "step.replicate(jdp.TrainState.create(...)). If that step is a plain function "
            f"around the {name} step (an EMA or metric wrapper), the backend could not see the "
            "strategy: decorate the wrapper with @jdp.wraps(train_step)."
        )
    if sharded.num_shards != n:
        raise ValueError(
            f"jdp.strategies.{name}: the state is split {sharded.num_shards} ways but the step runs on {n} "
            "devices. Re-place it: state = step.replicate(other_step.unreplicate(state)), or "
            "restore a checkpoint (checkpoints hold the whole state)."
        )


def update_slices(
    state: TrainState,
    slices: PyTree,
    like: PyTree,
    grads: PyTree,
    model_state: PyTree,
    axis_name: str,
    global_norm: NormFn = sharded_norm,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """:func:`jdp.apply_gradients` on this replica's parameter slices and optimizer rows.

    ``like`` holds the whole parameters' shapes (arrays or shape structs).
    The returned state's params are the new slices and its optimizer state
    the new rows (unwrapped). ``global_norm`` gives the norm of a tree of
    slices (:func:`sharded_norm`, or :func:`gathered_norm` in exact mode).
    """
    n = lax.axis_size(axis_name)
    sharded = state.opt_state
    view = state.replace(params=slices, opt_state=sharded.shards)

    def norm(tree: PyTree) -> jax.Array:
        return global_norm(tree, like, axis_name)

    tx = optax.with_extra_args_support(state.tx)
    split = [is_sharded_param(x.shape, n) for x in jax.tree.leaves(like)]
    rows = [shape is not None for shape in sharded.logical_shapes]
    check_elementwise(
        lambda g, s, p: tx.update(g, s, p, global_norm=norm),
        split + rows + split,
        grads,
        sharded.shards,
        slices,
    )
    return apply_gradients(
        view, grads, model_state=model_state, axis_name=axis_name, global_norm=norm
    )


def apply_sharded(
    state: TrainState, grads: PyTree, model_state: PyTree, axis_name: str
) -> tuple[TrainState, dict[str, jax.Array]]:
    """:func:`jdp.apply_gradients` on this replica's slices; the new params all-gathered."""
    n = lax.axis_size(axis_name)
    check_sharded(state.opt_state, n, "zero1")
    slices = param_slices(state.params, lax.axis_index(axis_name), n)
    new, info = update_slices(state, slices, state.params, grads, model_state, axis_name)
    return gather_cut(new, state, axis_name).replace(
        opt_state=ShardedOptState(new.opt_state, state.opt_state.logical_shapes, n)
    ), info


def cut_for_update(state: TrainState, grads: PyTree, axis_name: str) -> tuple[TrainState, PyTree]:
    """This replica's slices of the parameters and of whole gradients (exact mode's).

    Returns the state with its parameter slices, and the gradient slices.
    """
    n = lax.axis_size(axis_name)
    check_sharded(state.opt_state, n, "exact")
    index = lax.axis_index(axis_name)
    return state.replace(params=param_slices(state.params, index, n)), param_slices(grads, index, n)


def update_cut(
    state: TrainState, grads: PyTree, model_state: PyTree, axis_name: str, like: PyTree
) -> tuple[TrainState, dict[str, jax.Array]]:
    """:func:`update_slices` on a state :func:`cut_for_update` cut; a state of the same structure.

    A global-norm clip reads the whole tree's norm (:func:`gathered_norm`).
    ``like``: the whole parameters (their shapes).
    """
    sharded = state.opt_state
    new, info = update_slices(
        state, state.params, like, grads, model_state, axis_name, gathered_norm
    )
    rows = ShardedOptState(new.opt_state, sharded.logical_shapes, sharded.num_shards)
    return new.replace(opt_state=rows), info


def gather_cut(new: TrainState, old: TrainState, axis_name: str) -> TrainState:
    """The whole parameters of a state :func:`update_cut` updated (all-gathered)."""
    return new.replace(params=gather_params(new.params, old.params, axis_name))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm``, exact under :func:`zero1` as well.

    It reads optax's extra argument ``global_norm`` (a function of the
    updates) when the caller passes one: a zero1 step passes the norm over
    every replica's slices (one scalar ``psum``), so each slice is scaled by
    the same global factor. Without it, the plain norm: what optax computes.

    Args:
      max_norm: the largest global norm the updates keep; > 0.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> tx = jdp.clip_by_global_norm(1.0)
      >>> updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> [round(float(u), 4) for u in updates["w"]]
      [0.6, 0.8]
    """
    if isinstance(max_norm, (bool, str)):
        raise TypeError(
            f"jdp.clip_by_global_norm: max_norm must be a number > 0, got {max_norm!r}."
        )
    if not _positive(max_norm):
        raise ValueError(
            f"jdp.clip_by_global_norm: max_norm must be a number > 0, got {max_norm!r}; a "
            "non-positive bound would reverse or zero every update."
        )

    def update(updates, state, params=None, *, global_norm=optax.tree.norm, **extra_args):
        del params, extra_args
        norm = global_norm(updates)
        trigger = jnp.squeeze(norm < max_norm)
        clip = lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def all_rows(x: jax.Array) -> np.ndarray:
    """Every replica's row of a placed sharded leaf, on the host, in axis order."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    if x.is_fully_addressable:  # the pmap layout: this process's rows
        return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _positive(x: object) -> bool:
    if isinstance(x, (str, bytes)):
        return False
    try:
        return float(x) > 0  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False

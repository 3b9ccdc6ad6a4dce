"""Weight-update sharding (Xu et al. 2020; ZeRO stage 1): 1/n of the optimizer per replica.

``make_train_step(..., shard_optimizer=True)`` keeps data-parallel semantics
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
sharded-aware global-norm clip.

The placed optimizer state is a :class:`ShardedOptState`: leaves of shape
``(n, 1, ..., 1, c)``, row i on device i, in both backends. Checkpoints,
``step.unreplicate`` and ``jdp.unreplicate`` hold the logical layout, the one
``tx.init(params)`` returns.
"""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jax_core

from jdp import pytree
from jdp.types import PyTree
from jdp.weighting import safe_divide

# (axis name, per-parameter-leaf sharded flags) while a sharded update is traced.
_SHARDED_UPDATE: contextvars.ContextVar = contextvars.ContextVar("jdp_sharded_update", default=None)


@pytree.dataclass
class ShardedOptState:
    """The optimizer state of a ``shard_optimizer=True`` step, 1/n per device.

    Attributes:
      shards: ``tx.init`` of the parameter slices. Placed, a sharded leaf has
        shape ``(n, 1, ..., 1, c)``, row i on device i; other leaves (counts,
        the state of small parameters) are replicated like the rest of the
        state.
      logical_shapes: per leaf of ``shards``, the shape in ``tx.init(params)``
        when the leaf is sharded, else None.
      num_shards: n, the devices of the data axis.
    """

    shards: PyTree
    logical_shapes: tuple = pytree.static_field()
    num_shards: int = pytree.static_field()


def is_sharded_param(shape: tuple[int, ...], n: int) -> bool:
    """Whether a parameter leaf of this shape is split (n >= 2, rank >= 1, >= n elements)."""
    return n >= 2 and len(shape) >= 1 and math.prod(shape) >= n


def slice_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """One replica's slice of a split leaf: ``(1, ..., 1, ceil(size / n))``."""
    return (1,) * (len(shape) - 1) + (-(-math.prod(shape) // n),)


def _rows(x, n: int):
    """``(n, c)``: the flattened leaf, zero-padded, one row per replica."""
    flat = jnp.ravel(x)
    chunk = -(-flat.size // n)
    return jnp.pad(flat, (0, chunk * n - flat.size)).reshape(n, chunk)


def param_slices(params: PyTree, index: jax.Array, n: int) -> PyTree:
    """This replica's slice of every split leaf; small leaves whole."""

    def one(x):
        if not is_sharded_param(x.shape, n):
            return x
        return lax.dynamic_index_in_dim(_rows(x, n), index, keepdims=False).reshape(
            slice_shape(x.shape, n)
        )

    return jax.tree.map(one, params)


def slice_template(params: PyTree, n: int) -> PyTree:
    """Shape/dtype structs of one replica's parameter slices."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            slice_shape(x.shape, n) if is_sharded_param(x.shape, n) else x.shape, x.dtype
        ),
        params,
    )


def layout(tx: optax.GradientTransformation, params: PyTree, n: int) -> tuple:
    """``logical_shapes`` for ``tx`` on ``params`` split n ways.

    Raises:
      ValueError: the transform keeps state whose shape is not the parameter's
        (e.g. adafactor's factored moments), which a slice cannot hold exactly.
    """
    logical = jax.eval_shape(tx.init, params)
    sliced = jax.eval_shape(tx.init, slice_template(params, n))
    if jax.tree.structure(logical) != jax.tree.structure(sliced):
        raise ValueError(
            "shard_optimizer=True: the optimizer's state has another structure for parameter "
            "slices than for whole parameters, so it cannot be split exactly. Use an "
            "elementwise optimizer (sgd, momentum, adam, adamw, lion) or shard_optimizer=False."
        )
    shapes = []
    paths = jax.tree_util.tree_flatten_with_path(logical)[0]
    for (path, whole), part in zip(paths, jax.tree.leaves(sliced), strict=True):
        if whole.shape == part.shape:
            shapes.append(None)
        elif part.shape == slice_shape(whole.shape, n):
            shapes.append(tuple(whole.shape))
        else:
            raise ValueError(
                f"shard_optimizer=True: optimizer state leaf {jax.tree_util.keystr(path)} has "
                f"shape {whole.shape} for the whole parameters but {part.shape} for a slice "
                "(expected the slice's own shape): the transform keeps per-leaf statistics "
                "that are not elementwise (e.g. adafactor's factored moments). Use an "
                "elementwise optimizer or shard_optimizer=False."
            )
    return tuple(shapes)


def shard_opt_state(opt_state: PyTree, tx, params: PyTree, n: int) -> ShardedOptState:
    """The logical optimizer state cut into n slices per split leaf (host layout).

    Sharded leaves become ``(n, 1, ..., 1, c)`` arrays (not yet placed);
    others pass through.
    """
    shapes = layout(tx, params, n)
    leaves, treedef = jax.tree.flatten(opt_state)
    if len(leaves) != len(shapes):
        raise ValueError(
            "shard_optimizer=True: state.opt_state does not match state.tx.init(state.params) "
            f"({len(leaves)} leaves, expected {len(shapes)}); build the state with "
            "jdp.TrainState.create(params=..., tx=...)."
        )
    out = []
    for x, shape in zip(leaves, shapes, strict=True):
        if shape is None:
            out.append(x)
            continue
        if tuple(np.shape(x)) != shape:
            raise ValueError(
                f"shard_optimizer=True: an optimizer state leaf has shape {np.shape(x)}, "
                f"expected {shape} (the logical layout of tx.init(params)). Was it placed "
                "already? Pass the state as TrainState.create returns it."
            )
        rows = _rows(jnp.asarray(x), n)
        out.append(rows.reshape((n,) + slice_shape(shape, n)))
    return ShardedOptState(jax.tree.unflatten(treedef, out), shapes, n)


def logical_opt_state(state: ShardedOptState, rows_of=np.asarray) -> PyTree:
    """The logical (``tx.init(params)``) layout of a sharded optimizer state.

    Args:
      state: placed (or host) shards.
      rows_of: ``x -> (n, ...)`` host rows of a placed sharded leaf (default
        ``np.asarray``; several processes pass a gather over processes).
    """
    leaves, treedef = jax.tree.flatten(state.shards)
    out = []
    for x, shape in zip(leaves, state.logical_shapes, strict=True):
        if shape is None:
            out.append(x)
            continue
        flat = np.asarray(rows_of(x)).reshape(-1)
        out.append(flat[: math.prod(shape)].reshape(shape))
    return jax.tree.unflatten(treedef, out)


def reduce_scatter_gradients(
    grads: PyTree, axis_name: str, grad_reduce: str, weight: jax.Array | None
) -> PyTree:
    """:func:`jdp.reduce_gradients`, but each replica keeps only its slices.

    Split leaves are reduce-scattered in one ``psum_scatter`` per dtype; small
    leaves are all-reduced whole. The arithmetic is reduce_gradients' own.
    """
    n = lax.axis_size(axis_name)
    if weight is not None and grad_reduce == "sum":  # per-replica weighted means, summed
        grads = jax.tree.map(lambda g: safe_divide(g, weight.astype(g.dtype)), grads)
    leaves, treedef = jax.tree.flatten(grads)
    split = [is_sharded_param(x.shape, n) for x in leaves]
    small = [x for x, s in zip(leaves, split, strict=True) if not s]
    total = None
    if weight is not None and grad_reduce == "mean":
        small, total = lax.psum((small, weight), axis_name)
    else:
        small = lax.psum(small, axis_name)
    summed = iter(small)
    scattered = iter(_psum_scatter([x for x, s in zip(leaves, split, strict=True) if s], axis_name))
    out = [next(scattered) if s else next(summed) for s in split]
    if total is not None:
        out = [safe_divide(g, total.astype(g.dtype)) for g in out]
    elif grad_reduce == "mean":
        out = [g / n for g in out]  # lax.pmean's arithmetic: the sum, divided by n
    return jax.tree.unflatten(treedef, out)


def _psum_scatter(leaves: list[jax.Array], axis_name: str) -> list[jax.Array]:
    """Reduce-scatters each leaf's ``(n, c)`` rows (XLA combines the collectives)."""
    n = lax.axis_size(axis_name)
    return [
        lax.psum_scatter(_rows(x, n), axis_name, scatter_dimension=0).reshape(
            slice_shape(x.shape, n)
        )
        for x in leaves
    ]


def gather_params(slices: PyTree, like: PyTree, axis_name: str) -> PyTree:
    """Whole parameters from every replica's slices (one ``all_gather`` per split leaf)."""
    n = lax.axis_size(axis_name)

    def one(part, whole):
        if not is_sharded_param(whole.shape, n):
            return part
        flat = lax.all_gather(part.reshape(-1), axis_name, tiled=True)
        return flat[: whole.size].reshape(whole.shape)

    return jax.tree.map(one, slices, like)


def global_norm(tree: PyTree) -> jax.Array:
    """The global L2 norm; inside a sharded update, over every replica's slices."""
    context = _SHARDED_UPDATE.get()
    leaves = jax.tree.leaves(tree)
    if context is None:
        return optax.tree.norm(tree)
    axis_name, split = context
    if len(split) != len(leaves):
        raise ValueError(
            "jdp.clip_by_global_norm inside a sharded update expects a tree shaped like "
            f"the parameters ({len(split)} leaves), got {len(leaves)}."
        )
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves]
    parts = [q for q, s in zip(squares, split, strict=True) if s]
    whole = [q for q, s in zip(squares, split, strict=True) if not s]
    total = lax.psum(sum(parts, jnp.float32(0)), axis_name) + sum(whole, jnp.float32(0))
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``, exact under ``shard_optimizer=True`` as well.

    Outside a sharded step it computes what optax's does; inside, the norm is
    taken over every replica's slices (one scalar ``psum``), so each slice is
    scaled by the same global factor.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> tx = jdp.clip_by_global_norm(1.0)
      >>> updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> [round(float(u), 4) for u in updates["w"]]
      [0.6, 0.8]
    """

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        trigger = jnp.squeeze(norm < max_norm)
        clip = lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@contextlib.contextmanager
def sharded_update(axis_name: str, params: PyTree, n: int):
    """Marks the tracing of ``tx.update`` on slices, for :func:`global_norm`."""
    split = tuple(is_sharded_param(x.shape, n) for x in jax.tree.leaves(params))
    token = _SHARDED_UPDATE.set((axis_name, split))
    try:
        yield
    finally:
        _SHARDED_UPDATE.reset(token)


# Primitives that combine several elements of an array: applied to a slice,
# they give another result than on the whole leaf.
_COMBINING = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "reduce",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "top_k",
    "dot_general",
    "transpose",
    "rev",
    "fft",
}


def check_elementwise(update_fn, *args) -> None:
    """Refuses an update whose result depends on a reduction over a slice.

    Traces ``update_fn(*args)`` (inside a sharded update) and follows every
    value computed by a reduction over a non-scalar array to the outputs; a
    ``psum`` over the data axis (as in :func:`clip_by_global_norm`) makes it
    global again.

    Raises:
      ValueError: naming the primitive, when an output depends on one.
    """
    closed = jax.make_jaxpr(update_fn)(*args)
    culprit = _tainted_outputs(closed.jaxpr, [None] * len(closed.jaxpr.invars))
    found = next((c for c in culprit if c is not None), None)
    if found is not None:
        raise ValueError(
            f"shard_optimizer=True: the optimizer's update applies `{found}` across the "
            "elements of a parameter or of the whole tree (global-norm clipping, LAMB/LARS "
            "trust ratios, adafactor, apply_if_finite, ...), which on a 1/n slice would give "
            "a silently different update. Use jdp.clip_by_global_norm for global-norm "
            "clipping, an elementwise optimizer, or shard_optimizer=False."
        )


def _tainted_outputs(jaxpr, taints: list) -> list:
    """Per output: the combining primitive it depends on (not yet psum'd), or None."""
    env: dict = {}

    def read(v):
        return env.get(v) if isinstance(v, jax_core.Var) else None

    for v, t in zip(jaxpr.invars, taints, strict=True):
        env[v] = t
    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = _inner_jaxprs(eqn)
        if name == "psum":
            outs = [None] * len(eqn.outvars)
        elif inner:
            outs = _through_inner(eqn, inner, inputs)
        elif name in _COMBINING and any(
            getattr(getattr(v, "aval", None), "ndim", 0) >= 1 for v in eqn.invars
        ):
            outs = [name] * len(eqn.outvars)
        else:
            t = next((t for t in inputs if t is not None), None)
            outs = [t] * len(eqn.outvars)
        for v, t in zip(eqn.outvars, outs, strict=True):
            env[v] = t
    return [read(v) for v in jaxpr.outvars]


def _inner_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jax_core.Jaxpr):
                found.append(item)
    return found


def _through_inner(eqn, inner: list, inputs: list) -> list:
    if len(inner) == 1 and len(inner[0].invars) == len(inputs):
        outs = _tainted_outputs(inner[0], inputs)
        if len(outs) == len(eqn.outvars):
            return outs
    # Control flow: conservatively, any taint inside or outside reaches every output.
    incoming = next((t for t in inputs if t is not None), None)
    for jaxpr in inner:
        seed = [incoming] * len(jaxpr.invars)
        incoming = incoming or next((t for t in _tainted_outputs(jaxpr, seed) if t), None)
    return [incoming] * len(eqn.outvars)


def place(
    tree: PyTree, n: int, replicate_fn, sharding: jax.sharding.NamedSharding, row_of
) -> PyTree:
    """Places a whole TrainState for a sharded step.

    The optimizer state is split n ways (row ``row_of(device)`` on each
    device, as a ``(mesh size, ...)`` array with ``sharding``); everything else
    is placed by ``replicate_fn`` (the backend's replication). With several
    processes, process 0's values are used everywhere, as by ``jdp.replicate``.
    """
    from jdp.replication import from_process0

    if isinstance(tree.opt_state, ShardedOptState):
        raise ValueError(
            "replicate: the state's optimizer state is already split over devices; pass the "
            "whole state (step.unreplicate(state)) to place it again."
        )
    tree = from_process0(tree)
    sharded = shard_opt_state(tree.opt_state, tree.tx, tree.params, n)
    leaves, treedef = jax.tree.flatten(sharded.shards)
    holes = [None if shape else x for x, shape in zip(leaves, sharded.logical_shapes, strict=True)]
    placed = replicate_fn(
        tree.replace(
            opt_state=ShardedOptState(jax.tree.unflatten(treedef, holes), sharded.logical_shapes, n)
        )
    )
    kept = jax.tree.leaves(placed.opt_state.shards, is_leaf=lambda x: x is None)
    out = [
        _place_rows(np.asarray(x), sharding, row_of) if shape else k
        for x, k, shape in zip(leaves, kept, sharded.logical_shapes, strict=True)
    ]
    shards = jax.tree.unflatten(treedef, out)
    return placed.replace(opt_state=ShardedOptState(shards, sharded.logical_shapes, n))


def _place_rows(rows: np.ndarray, sharding: jax.sharding.NamedSharding, row_of) -> jax.Array:
    arrays = [
        jax.device_put(rows[row_of(d)][None], d, may_alias=False)
        for d in sharding.addressable_devices
    ]
    shape = (sharding.mesh.size,) + rows.shape[1:]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def all_rows(x: jax.Array) -> np.ndarray:
    """Every replica's row of a placed sharded leaf, on the host, in axis order."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    if x.is_fully_addressable:  # the pmap layout: this process's rows
        return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def whole(state: ShardedOptState, replica0) -> PyTree:
    """The logical optimizer state; replicated leaves through ``replica0``."""
    leaves, treedef = jax.tree.flatten(state.shards)
    kept = [
        x if shape else replica0(x) for x, shape in zip(leaves, state.logical_shapes, strict=True)
    ]
    host = ShardedOptState(
        jax.tree.unflatten(treedef, kept), state.logical_shapes, state.num_shards
    )
    return logical_opt_state(host, rows_of=lambda x: all_rows(x) if isinstance(x, jax.Array) else x)


def is_sharded_state(x) -> bool:
    return isinstance(x, ShardedOptState)


def map_shards(state: PyTree, fn) -> PyTree:
    """``state`` with ``fn`` applied to the sharded optimizer leaves (if any)."""
    sharded = getattr(state, "opt_state", None)
    if not isinstance(sharded, ShardedOptState):
        return state
    leaves, treedef = jax.tree.flatten(sharded.shards)
    new = [fn(x) if shape else x for x, shape in zip(leaves, sharded.logical_shapes, strict=True)]
    return state.replace(
        opt_state=ShardedOptState(
            jax.tree.unflatten(treedef, new), sharded.logical_shapes, sharded.num_shards
        )
    )


def without_split_leaves(tree: PyTree) -> PyTree:
    """``tree`` with the sharded optimizer leaves (which differ per replica) left out."""

    def drop(x):
        if not is_sharded_state(x):
            return x
        leaves, treedef = jax.tree.flatten(x.shards)
        kept = [None if shape else y for y, shape in zip(leaves, x.logical_shapes, strict=True)]
        return jax.tree.unflatten(treedef, kept)

    return jax.tree.map(drop, tree, is_leaf=is_sharded_state)

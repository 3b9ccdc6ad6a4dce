"""Fully sharded data parallelism (ZeRO-3, FSDP): 1/n of the parameters, gradients and optimizer.

``make_train_step(..., strategy=jdp.strategies.fsdp())`` keeps data-parallel
semantics, but each replica holds one slice of every parameter leaf (the
slices of :func:`jdp.strategies.zero1`: flattened, zero-padded, cut in n),
of its gradient and of its optimizer state; leaves with fewer than n
elements stay whole on every replica. Inside the step the parameters are
all-gathered for the forward and backward passes, and the gathering's
backward is a reduce-scatter: each replica receives the sum over replicas
of its slice's gradient as the backward produces it, and runs ``tx.update``
on its slices. Nothing is gathered after the update.

Layer by layer: by default a split leaf is gathered when the loss starts
and kept until its gradient is reduced. Leaves that ``fsdp(layers=...)``
selects reach the loss as :class:`Shard` nodes instead, and a layer function
wrapped in :func:`layer` gathers its own parameters when it runs, frees them
after, and gathers them again in the backward pass: only the layers being
computed are ever whole on a device (``docs/memory.md``). Leaves stacked over
layers (a scanned model's blocks) that ``fsdp(stacked=...)`` selects are cut
layer by layer, and a scan hands each layer its own Shard.

The placed parameters are a :class:`ShardedParams` and the optimizer state a
:class:`jdp.strategies.ShardedOptState`; checkpoints, ``jdp.unreplicate`` and
``step.unreplicate`` hold the logical layout, so a state moves between
``fsdp``, ``zero1`` and ``data_parallel`` on any device count.
"""

import functools
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from jdp import _tree
from jdp._forward import Forward
from jdp._layout import Placement
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp._weighting import safe_divide
from jdp.distributed import from_process0
from jdp.strategies._base import PSUM, Communication, Reduced, Strategy, check_communication
from jdp.strategies._data_parallel import check_reduce, local_contribution, reduced
from jdp.strategies._slices import PerLayer, Record, _rows, slice_shape, whole_shape
from jdp.strategies._zero1 import (
    ShardedOptState,
    _split,
    check_sharded,
    layout,
    param_records,
    sharded_norm,
    update_slices,
)

_F = TypeVar("_F", bound=Callable[..., Any])


@_tree.dataclass
class ShardedParams(ShardedOptState):
    """The parameters of a :func:`fsdp` step, 1/n per device.

    The same node as :class:`jdp.strategies.ShardedOptState` (``shards``,
    ``logical_shapes``, ``num_shards``), holding the parameters: a split
    leaf is placed with shape ``(n, 1, ..., 1, c)``, row i on device i, and
    read in its logical shape by checkpoints and ``jdp.unreplicate``.
    """


@_tree.dataclass
class Shard:
    """A split parameter leaf as the loss receives it under ``fsdp(layers=...)``.

    Pass it to a function wrapped in :func:`layer`, which gathers it.

    Attributes:
      data: this replica's slice, shape ``(1, ..., 1, c)``; of a stacked
        leaf, ``(L, 1, ..., 1, c)`` until a scan slices one layer.
      shape: the whole leaf's shape (of a stacked leaf, one layer's).
      axis_name: the data axis.
      communication: the collectives its gradient is reduced with.
      probe: gather without collectives (for tracing shapes only).
    """

    data: jax.Array
    shape: tuple[int, ...] = _tree.static_field()
    axis_name: str = _tree.static_field()
    communication: Communication = _tree.static_field()
    probe: bool = _tree.static_field()


def _not_an_array(operation: str) -> Callable[..., Any]:
    def refuse(self: Shard, *_: object) -> Any:
        raise TypeError(
            f"jdp.strategies.Shard: the loss used a split parameter of shape {self.shape} as an "
            f"array ({operation}): fsdp(layers=...) and fsdp(stacked=...) hand the leaves they "
            "select to the loss split. Gather it where it is used: wrap that function in "
            "jdp.strategies.layer, or call jdp.strategies.gather(params) there (for a stacked "
            "leaf, inside the body of the scan over its layers)."
        )

    return refuse


# A Shard reaching an operator would otherwise fail with Python's or JAX's
# bare "unsupported operand" error, which does not say what the node is.
_BINARY = {"add": "+", "sub": "-", "mul": "*", "matmul": "@", "truediv": "/", "pow": "**"}
_BINARY |= {"floordiv": "//", "mod": "%"}
for _name, _operation in {
    **{f"__{op}__": symbol for op, symbol in _BINARY.items()},
    **{f"__r{op}__": symbol for op, symbol in _BINARY.items()},
    "__neg__": "-",
    "__pos__": "+",
    "__abs__": "abs",
    "__getitem__": "indexing",
    "__array__": "numpy.asarray",
    **{f"__{op}__": op for op in ("lt", "le", "gt", "ge")},
}.items():
    setattr(Shard, _name, _not_an_array(_operation))


def _is_shard(x: object) -> bool:
    return isinstance(x, Shard)


def _after(x: jax.Array, anchor: Any) -> jax.Array:
    """``x`` unchanged bit for bit, but computed after ``anchor`` (None: no anchor).

    XLA:CPU removes optimization barriers before it schedules (its
    cse-barrier-expander pass), then schedules every all-gather first and
    merges the backward pass's re-gather with the forward's by CSE: a
    12-layer step measured 23 MiB of temporaries against 2 MiB with this
    dependency. Adding -0.0 keeps every value, -0.0 and NaN included; a
    non-finite anchor makes it NaN, in a layer whose output is already so.
    """
    if anchor is None:
        return x
    return x + -(jnp.abs(jnp.ravel(anchor)[0].astype(x.dtype)) * 0)


def _anchor(tree: PyTree) -> jax.Array | None:
    leaves = [  # numbers only: not keys, not float0 cotangents
        x
        for x in jax.tree.leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.number) and jnp.size(x)
    ]
    return leaves[0] if leaves else None


Spec = tuple[tuple[int, ...], str, Communication, bool]


def _all_gather(data: jax.Array, spec: Spec, anchor: Any = None) -> jax.Array:
    shape, axis_name, _, probe = spec
    flat = _after(data.reshape(-1), anchor)
    if probe:  # the shape of the gathered leaf, with no collective
        flat = jnp.tile(flat, lax.axis_size(axis_name))
    else:
        flat = lax.all_gather(flat, axis_name, tiled=True)
    return flat[: math.prod(shape)].reshape(shape)


def _reduce_scatter(ct: jax.Array, spec: Spec) -> jax.Array:
    shape, axis_name, communication, probe = spec
    n = lax.axis_size(axis_name)
    rows = _rows(ct, n)
    part = rows[0] if probe else communication.reduce_scatter([rows], axis_name)[0]
    return part.reshape(slice_shape(shape, n)).astype(ct.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(data: jax.Array, spec: Spec) -> jax.Array:
    return _all_gather(data, spec)


def _gather_fwd(data: jax.Array, spec: Spec):
    return _all_gather(data, spec), None


def _gather_bwd(spec: Spec, _: None, ct: jax.Array):
    return (_reduce_scatter(ct, spec),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def layer(fn: _F) -> _F:
    """Marks one layer of a model trained with ``fsdp(layers=...)``.

    ``layer(fn)(params, *args)`` calls ``fn(params, *args)``. When ``params``
    holds :class:`Shard` nodes (the leaves ``fsdp(layers=...)`` selects), it
    gathers them just before ``fn`` runs, keeps only the slices and ``args``
    for the backward pass, gathers again there and reduce-scatters the
    gradient: one layer whole on a device at a time. Without Shard nodes
    (any other strategy, evaluation on one device) it is ``fn`` itself.

    Args:
      fn: ``(params, *args) -> outputs``, the layer; ``args`` are arrays
        (bind other arguments with ``functools.partial``).

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> block = jdp.strategies.layer(lambda p, x: jnp.tanh(x @ p["w"]))
      >>> [round(float(v), 4) for v in block({"w": jnp.eye(2)}, jnp.ones((1, 2)))[0]]
      [0.7616, 0.7616]
    """

    if not callable(fn):
        raise TypeError(
            "jdp.strategies.layer takes the layer's function, (params, *args) -> outputs, e.g. "
            f"jdp.strategies.layer(block_fn); got {fn!r} ({type(fn).__name__})."
        )

    @functools.wraps(fn)
    def wrapped(params: PyTree, *args: Any) -> Any:
        nodes, treedef = jax.tree.flatten(params, is_leaf=_is_shard)
        if not any(_is_shard(x) for x in nodes):
            return fn(params, *args)
        return _gathered_call(fn, nodes, treedef, args)

    return wrapped  # type: ignore[return-value]


def _check_slice(shard: Shard, where: str) -> None:
    """A Shard holds one layer's slice: a stacked leaf not scanned over, or a leaf a scan
    sliced that was not stacked, would gather the wrong elements."""
    n = lax.axis_size(shard.axis_name)
    expected = slice_shape(shard.shape, n)
    if tuple(shard.data.shape) != expected:
        raise ValueError(
            f"{where}: a parameter slice has shape {tuple(shard.data.shape)}, but one layer's "
            f"slice of a {shard.shape} leaf on {n} replicas has shape {expected}. A leaf that "
            "fsdp(stacked=...) selects holds every layer: gather it inside the body of a scan "
            "over its leading axis (jax.lax.scan, nn.scan); a leaf a scan slices must be "
            "selected by fsdp(stacked=...)."
        )


def gather(tree: PyTree) -> PyTree:
    """``tree`` with every :class:`Shard` gathered whole; other leaves as they are.

    For a model that gathers its own layer's parameters where
    :func:`layer` cannot wrap it, e.g. a Flax Linen block inside ``nn.scan``:
    ``nn.map_variables(Block, "params", trans_in_fn=jdp.strategies.gather)``
    (with ``nn.remat`` around it, the backward pass gathers again rather
    than keep the whole layer). The gather's gradient is reduce-scattered.
    Without Shard nodes it returns ``tree``.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> jdp.strategies.gather({"w": jnp.ones(2)})["w"].tolist()
      [1.0, 1.0]
    """
    nodes, treedef = jax.tree.flatten(tree, is_leaf=_is_shard)
    out = []
    for x in nodes:
        if _is_shard(x):
            _check_slice(x, "jdp.strategies.gather")
            x = _gather(x.data, (x.shape, x.axis_name, x.communication, x.probe))
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _gathered_call(fn: Callable[..., Any], nodes: list, treedef: Any, args: tuple) -> Any:
    shards = [x for x in nodes if _is_shard(x)]
    for x in shards:
        _check_slice(x, f"jdp.strategies.layer({getattr(fn, '__name__', fn)!r})")
    others = [x for x in nodes if not _is_shard(x)]
    specs = tuple((s.shape, s.axis_name, s.communication, s.probe) for s in shards)

    def whole(gathered: list, rest: list, inputs: tuple) -> Any:
        it, ot = iter(gathered), iter(rest)
        tree = treedef.unflatten([next(it) if _is_shard(x) else next(ot) for x in nodes])
        return fn(tree, *inputs)

    example = [jnp.zeros(s.shape, s.data.dtype) for s in shards]
    try:
        closed, consts = jax.closure_convert(whole, example, others, args)
    except TypeError as e:
        raise TypeError(
            f"jdp.strategies.layer({getattr(fn, '__name__', fn)!r}): the layer's arguments "
            f"after params must be arrays ({e}); bind other values with functools.partial."
        ) from None
    return _layer_call(closed, specs, [s.data for s in shards], others, args, consts)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layer_call(fn, specs, datas, others, args, consts):
    anchor = _anchor(args)
    whole = [_all_gather(d, s, anchor) for d, s in zip(datas, specs, strict=True)]
    return fn(whole, others, args, *consts)


def _layer_fwd(fn, specs, datas, others, args, consts):
    return _layer_call(fn, specs, datas, others, args, consts), (datas, others, args, consts)


def _layer_bwd(fn, specs, residuals, ct):
    datas, others, args, consts = residuals
    anchor = _anchor(ct)
    whole = [_all_gather(d, s, anchor) for d, s in zip(datas, specs, strict=True)]
    _, vjp = jax.vjp(lambda w, o, a, c: fn(w, o, a, *c), whole, others, args, consts)
    d_whole, d_others, d_args, d_consts = vjp(ct)
    parts = [_reduce_scatter(g, s) for g, s in zip(d_whole, specs, strict=True)]
    return parts, d_others, d_args, d_consts


_layer_call.defvjp(_layer_fwd, _layer_bwd)


def _marked(params: PyTree, layers: Callable[[str], bool] | None) -> list[bool]:
    if layers is None:
        return [False] * len(jax.tree.leaves(params))
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return [bool(layers(jax.tree_util.keystr(path))) for path, _ in paths]


def _view(
    local: PyTree,
    shapes: Sequence[Record | None],
    marked: Sequence[bool],
    axis_name: str,
    communication: Communication,
    probe: bool,
) -> PyTree:
    """What the loss sees: split leaves gathered, or as Shard nodes where marked or stacked."""
    leaves, treedef = _tree.flatten(local)
    out = []
    for x, shape, mark in zip(leaves, shapes, marked, strict=True):
        if shape is None:
            out.append(x)
        elif isinstance(shape, PerLayer):  # a scan over it hands each layer its Shard
            out.append(Shard(x, shape.shape[1:], axis_name, communication, probe))
        elif mark:
            out.append(Shard(x, shape, axis_name, communication, probe))
        else:
            out.append(_gather(x, (shape, axis_name, communication, probe)))
    return jax.tree.unflatten(treedef, out)


def fsdp(
    *,
    reduce: Literal["mean", "sum"] = "mean",
    accumulate_steps: int = 1,
    communication: Communication = PSUM,
    layers: Callable[[str], bool] | None = None,
    stacked: Callable[[str], bool] | None = None,
) -> Strategy:
    """Fully sharded data parallelism: 1/n of the parameters, gradients and optimizer per replica.

    The same update as :func:`data_parallel` for elementwise optimizers
    (a transform that reduces over a slice is refused when the step is first
    traced, as under :func:`zero1`; :func:`jdp.clip_by_global_norm` is
    exact). Place the state with the wrapped step's ``replicate``.

    Args:
      reduce: as for :func:`data_parallel`; ``"sum"`` takes a plain loss
        (with a :class:`jdp.WeightedLoss` the per-replica division would
        have to precede the reduction, which runs inside the backward pass).
      accumulate_steps: as for :func:`data_parallel` (every micro-batch
        gathers the parameters and reduce-scatters its gradient).
      communication: the collectives gradients cross with.
      layers: ``keystr(path) -> bool`` on parameter leaves (e.g.
        ``lambda path: path.startswith("['blocks']")``): the leaves the
        loss receives as :class:`Shard` nodes, for layer functions wrapped
        in :func:`layer` to gather one at a time. None: every split leaf is
        gathered when the loss starts.
      stacked: ``keystr(path) -> bool`` on parameter leaves stacked over
        layers on their leading axis (a ``jax.lax.scan`` or ``nn.scan``
        model's blocks): each layer is split on its own, and the loss
        receives the leaf as a :class:`Shard` whose leading axis a scan
        slices, so that :func:`layer` or :func:`gather` in the scan's body
        gathers one layer at a time. A leaf whose layers have fewer than n
        elements stays whole. None: no leaf is stacked.

    Example:
      >>> import jax.numpy as jnp, optax, jdp
      >>> step = jdp.pmap(jdp.make_train_step(lambda p, b: jnp.mean((b @ p) ** 2),
      ...                                     strategy=jdp.strategies.fsdp()))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(16), tx=optax.adam(0.1)))
      >>> type(state.params).__name__, state.params.shards.shape
      ('ShardedParams', (8, 2))
    """
    check_reduce(reduce, accumulate_steps, communication, "jdp.strategies.fsdp")
    for name, value in (("layers", layers), ("stacked", stacked)):
        if value is not None and not callable(value):
            raise TypeError(
                f"jdp.strategies.fsdp: {name} must be a function of a parameter's key path "
                f"(jax.tree_util.keystr), e.g. lambda path: 'blocks' in path; got {value!r}."
            )

    def gradients(forward: Forward, state: TrainState, batch: PyTree, axis_name: str) -> Reduced:
        check_communication(communication, state, "fsdp")
        n = lax.axis_size(axis_name)
        check_sharded(state.params, n, "fsdp")
        shapes = state.params.logical_shapes
        marked = _marked(state.params.shards, layers)
        view = partial(
            _view, shapes=shapes, marked=marked, axis_name=axis_name, communication=communication
        )
        local = local_contribution(
            partial(forward, view=partial(view, probe=False), zero_weightless=False),
            state.replace(params=state.params.shards),
            batch,
            axis_name,
            accumulate_steps,
            probe=partial(forward, view=partial(view, probe=True), zero_weightless=False),
            split=[shape is not None for shape in shapes],
        )
        grads = _finish(local.grads, shapes, axis_name, reduce, local.weight, communication)
        return reduced(local, grads, axis_name, [shape is not None for shape in shapes])

    def whole_params(state: TrainState, axis_name: str) -> PyTree:
        shapes = state.params.logical_shapes
        return _view(
            state.params.shards,
            shapes,
            _marked(state.params.shards, layers),
            axis_name,
            communication,
            probe=False,
        )

    placing = partial(place, stacked=stacked)
    return Strategy("fsdp", gradients, apply_fsdp, fsdp_norm, placing, whole_params=whole_params)


def _finish(
    grads: PyTree,
    shapes: Sequence[Record | None],
    axis_name: str,
    reduce: str,
    weight: jax.Array | None,
    communication: Communication,
) -> PyTree:
    """Reduced gradients: split leaves are summed already; small leaves are all-reduced."""
    n = lax.axis_size(axis_name)
    if weight is not None and reduce == "sum":
        raise ValueError(
            "jdp.strategies.fsdp(reduce='sum') with a jdp.WeightedLoss: 'sum' adds each "
            "replica's weighted mean, but fsdp reduces the gradients inside the backward pass, "
            "before a replica's own weight could divide them. Use reduce='mean' (the "
            "gradient of sum(totals) / sum(weights)) or a plain scalar loss."
        )
    leaves, treedef = _tree.flatten(grads)
    small = communication.all_reduce(
        [g for g, shape in zip(leaves, shapes, strict=True) if shape is None], axis_name
    )
    summed = iter(small)
    out = [next(summed) if shape is None else g for g, shape in zip(leaves, shapes, strict=True)]
    if weight is not None:
        total = lax.psum(weight, axis_name)
        out = [safe_divide(g, total.astype(g.dtype)) for g in out]
    elif reduce == "mean":
        out = [g / n for g in out]  # lax.pmean's arithmetic: the sum, divided by n
    return jax.tree.unflatten(treedef, out)


def _like(params: ShardedParams) -> PyTree:
    """Shape structs of the whole parameters."""
    leaves, treedef = _tree.flatten(params.shards)
    structs = [
        jax.ShapeDtypeStruct(whole_shape(shape) if shape is not None else x.shape, x.dtype)
        for x, shape in zip(leaves, params.logical_shapes, strict=True)
    ]
    return jax.tree.unflatten(treedef, structs)


def fsdp_norm(tree: PyTree, params: PyTree, axis_name: str) -> jax.Array:
    """The global L2 norm of a tree of this replica's slices (see :func:`zero1`'s)."""
    return sharded_norm(tree, _like(params), axis_name)


def apply_fsdp(
    state: TrainState, grads: PyTree, model_state: PyTree, axis_name: str
) -> tuple[TrainState, dict[str, jax.Array]]:
    """:func:`jdp.apply_gradients` on this replica's slices; nothing is gathered."""
    n = lax.axis_size(axis_name)
    check_sharded(state.params, n, "fsdp")
    check_sharded(state.opt_state, n, "fsdp")
    params = state.params
    new, info = update_slices(state, params.shards, _like(params), grads, model_state, axis_name)
    return new.replace(
        params=ShardedParams(new.params, params.logical_shapes, n),
        opt_state=ShardedOptState(new.opt_state, state.opt_state.logical_shapes, n),
    ), info


def place(
    state: TrainState, placement: Placement, stacked: Callable[[str], bool] | None = None
) -> TrainState:
    """A whole TrainState placed for an fsdp step: params and optimizer state split.

    ``stacked`` selects the leaves cut layer by layer (:func:`fsdp`). With
    several processes, process 0's values are used everywhere, as by
    ``jdp.replicate``.
    """
    if isinstance(state.params, ShardedOptState) or isinstance(state.opt_state, ShardedOptState):
        raise ValueError(
            "jdp.strategies.fsdp: replicate got a state already split over devices; pass the whole state "
            "(step.unreplicate(state)) to place it again."
        )
    state = from_process0(state)
    n = placement.size
    records = param_records(state.params, n, _marked(state.params, stacked))
    split = _split(state.params, records, placement)
    params = ShardedParams(split.shards, split.logical_shapes, n)
    opt_state = _split(state.opt_state, layout(state.tx, state.params, n, records), placement)
    rest = placement.replicate(state.replace(params=None, opt_state=None))
    return rest.replace(params=params, opt_state=opt_state)

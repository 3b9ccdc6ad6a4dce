"""Exact mode: the same bits on any number of devices.

``make_train_step(..., strategy=jdp.strategies.exact(G))`` splits the global batch into G
micro-batches ("virtual replicas") of B/G examples. Each device computes the
gradients of its G/n virtual replicas one at a time, and every sum over
virtual replicas follows one fixed binary tree over the G indices. Every
floating-point operation and its order is then independent of the device
count n, so params, optimizer state and metrics are bitwise equal for any n
that divides G, on one process or several.

What makes it hold on XLA (each measured on XLA:CPU, JAX 0.10):
micro-batches run one at a time in a loop (batching them with ``vmap``
changes how a sum over the batch axis rounds; unrolled copies fuse
differently with what surrounds them); no arithmetic collective is used (``psum`` reduces in an
n-dependent order): devices exchange partial sums with ``all_to_all`` and
``all_gather`` only, and the tree is finished in this module; the program
after the last collective is the same for every n; and the step compiles
without CSE, so one device and many run the same passes.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree

from jdp import _phases, _schedule, _tree, metrics
from jdp._args import check_int
from jdp._bitflip import FaultedBatch, flip_rows
from jdp._collectives import refuse_collectives
from jdp._conv_layout import evaluate_canonical
from jdp._forward import Contribution, Forward
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp._weighting import safe_divide
from jdp.strategies._base import (
    Reduced,
    Strategy,
    UpdateFn,
    plain_norm,
    refuse_per_replica,
    replicate_state,
    whole_state_update,
)
from jdp.strategies._recompute import check as recompute_check
from jdp.strategies._recompute import plan as recompute_plan
from jdp.strategies._recompute import skipped as recompute_skipped
from jdp.strategies._zero1 import cut_for_update, gather_cut, update_cut
from jdp.strategies._zero1 import place as zero1_place


def exact(
    virtual_replicas: int,
    *,
    shard_optimizer_state: bool = False,
    recompute_every: int | None = None,
) -> Strategy:
    """Exact mode: bitwise the same result on any number of devices and processes.

    The global batch is split into ``virtual_replicas`` micro-batches (a power
    of two that the device count divides) whose gradients are summed in one
    fixed order (``docs/exact.md``). Metrics are the global values, identical
    on every device, plus ``virtual_replica_loss``: each virtual replica's own
    loss, shape (G,). It takes no ``accumulate_steps`` (the virtual replicas
    are the micro-batches) and no ``reduce`` (it gives the exact global mean).

    Args:
      virtual_replicas: G, the micro-batches of a step.
      shard_optimizer_state: split the optimizer state 1/n over the devices,
        as :func:`zero1` does: each device updates its slices of the
        parameters and the new parameters are all-gathered. Bitwise the same
        as without it, on any device count (a global-norm clip all-gathers
        the clipped tree to take its norm as the unsharded step does).
      recompute_every: every this many steps, each device also computes one
        of its neighbour's virtual replicas and the two results' hashes are
        compared; where they differ a third device computes it, and the
        device that computed wrong is named (the ``recompute`` metric, checked
        by the backend like :class:`jdp.Audit`'s result: ``docs/audit.md``).
        A checked step computes one more micro-batch per device. Off (None)
        by default; the result is the same bits either way.

    Example:
      >>> import jax.numpy as jnp, jdp
      >>> step = jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2),
      ...                            strategy=jdp.strategies.exact(8))
      >>> step.strategy.name
      'exact'
    """
    check_virtual_replicas(virtual_replicas)
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(
            "jdp.strategies.exact: shard_optimizer_state must be True or False, got "
            f"{shard_optimizer_state!r}."
        )

    if recompute_every is not None:
        check_int(recompute_every, "recompute_every", minimum=1, where="jdp.strategies.exact")

    def gradients(forward: Forward, state: TrainState, batch: PyTree, axis_name: str) -> Reduced:
        refuse_per_replica(state, "exact", "params")
        rng = None if state.rng is None else jax.random.fold_in(state.rng, state.step)
        fault = None
        if isinstance(batch, FaultedBatch):  # jdp.testing.with_faults(..., target="gradients")
            batch, fault = batch.data, batch.spec
        return exact_gradients(
            forward, state, batch, rng, virtual_replicas, axis_name, recompute_every, fault
        )

    return Strategy(
        "exact",
        gradients,
        _sharded_update if shard_optimizer_state else _opaque_update(whole_state_update("exact")),
        plain_norm,
        zero1_place if shard_optimizer_state else replicate_state,
        compiler_options=EXACT_COMPILER_OPTIONS,
        checks=(("recompute", recompute_every),) if recompute_every is not None else (),
        # The global values, on every replica alike.
        metric_rules=(
            ("loss", metrics.same),
            ("virtual_replica_loss", metrics.same),
            *((("recompute", metrics.exact_int),) if recompute_every is not None else ()),
        ),
    )


# XLA compiles a one-device program without its SPMD partitioner, whose
# clean-up merges duplicate operations (CSE) before the algebraic simplifier
# runs; the simplifier's rewrites depend on how many users an operation has
# (``A / broadcast(B)`` in attention's softmax became ``A * (1 / B)`` at n = 1
# only: Flax SelfAttention's gradients 3e-13 off, Adam 2.5e-4 after 4 steps).
# Without CSE every device count compiles the same graph (measured: dense,
# LayerNorm, batched einsum, softmax and Flax attention probes and the model
# zoo bitwise at n = 1, 2, 4, 8).
# On GPUs XLA's scatter-add and some reductions use atomics by default, whose
# order changes from run to run: on an H200 (jax 0.11.2) the zoo's transformer
# and tied-embedding families did not repeat their own bits and pmap differed
# from shard_map on the weight-0 step; with deterministic ops all 11 families
# repeated and the backends agreed. XLA:CPU ignores the option.
EXACT_COMPILER_OPTIONS = (
    ("xla_disable_hlo_passes", "cse"),
    ("xla_gpu_deterministic_ops", True),
)


def check_virtual_replicas(virtual_replicas: object) -> None:
    """Validates ``virtual_replicas`` when the strategy is built."""
    g = virtual_replicas
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1):
        raise ValueError(
            f"jdp.strategies.exact: virtual_replicas must be a power of two (1, 2, 4, 8, ...), "
            f"got {g!r}: the fixed reduction tree pairs virtual replicas level by level, and "
            "only power-of-two blocks line up with it for every device count."
        )


def tree_sum(stacked: jax.Array) -> jax.Array:
    """Sums over the leading axis (a power of two) pairwise, level by level.

    ``((x0 + x1) + (x2 + x3)) + ...``: the same tree whatever the device
    count, because every device's block of virtual replicas is an aligned
    subtree of it.
    """
    while stacked.shape[0] > 1:
        stacked = stacked[0::2] + stacked[1::2]
    return stacked[0]


def exact_sum(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    """The sum of every device's ``x`` (already its block's subtree sum).

    Each device receives its 1/n slice of every device's partial sum
    (``all_to_all``), finishes the top levels of the tree on that slice, and
    the slices are gathered back (``all_gather``). Data movement only: no
    collective does arithmetic.
    """

    flat = x.reshape(-1)
    chunk = -(-flat.size // n)
    flat = jnp.pad(flat, (0, chunk * n - flat.size))
    parts = lax.all_to_all(flat.reshape(n, chunk), axis_name, 0, 0, tiled=False)
    whole = lax.all_gather(tree_sum(parts), axis_name, tiled=True)
    return whole[: x.size].reshape(x.shape)


def exact_gradients(
    forward: Forward,
    state: TrainState,
    batch: PyTree,
    rng: jax.Array | None,
    virtual_replicas: int,
    axis_name: str,
    recompute_every: int | None = None,
    fault: jax.Array | None = None,
) -> Reduced:
    """This step's exact global gradient, loss, model state and aux.

    Args:
      forward: ``(state, params, model_state, micro_batch, rng) -> Contribution``,
        the step's forward and backward pass for one micro-batch.
      state: the step's input state.
      batch: this device's part of the global batch.
      rng: the step's base key (``fold_in(state.rng, state.step)``) or None;
        each virtual replica folds in its global index.
      virtual_replicas: G.
      axis_name: the data axis.
      recompute_every: check each device's computation every this many
        steps (:mod:`jdp.strategies._recompute`), or None.
      fault: a gradient fault's spec (``jdp.testing.with_faults``), or None.
    """
    n = lax.axis_size(axis_name)
    per_device = virtual_replicas // n
    outs, check = _this_devices_virtual_replicas(
        forward, state, batch, rng, virtual_replicas, axis_name, recompute_every, fault
    )
    outs = _phases.mark_contribution(outs, axis_name, rows=True)
    weighted = outs.weight is not None
    weights = outs.weight if weighted else jnp.ones((per_device,), jnp.float32)
    # Two collectives in all, whatever the model: one small all_gather of
    # every scalar the devices share, and one all_to_all + all_gather of the
    # gradients and floating model state, packed into a single vector.
    shared, every = _shared_scalars(outs, weights, weighted, axis_name)
    # A plain loss divides by the constant G on every device count: a total
    # computed through collectives would be a constant only where n = 1 (XLA
    # drops one-device collectives), and folding it there changes the bits.
    total_weight = shared["weight"] if weighted else jnp.float32(virtual_replicas)
    floating, rebuild = _floating_model_state(outs.model_state, weights, axis_name)
    vector, unravel = ravel_pytree({"grads": jax.tree.map(tree_sum, outs.grads), "state": floating})
    summed = unravel(exact_sum(vector, axis_name, n))
    grads = jax.tree.map(lambda g: _divide(g, total_weight, weighted), summed["grads"])
    model_state = rebuild(summed["state"], total_weight)
    loss = safe_divide(shared["total"], total_weight)
    aux = {name: safe_divide(v, total_weight) for name, v in shared["aux"].items()}
    # ``weight`` stays per device (this device's share), as in the ordinary
    # step, so summing it over devices gives the global weight.
    mine = tree_sum(weights) if weighted else None
    grads, seen = _phases.mark_gradients(
        _phases.REDUCTION, grads, {"model_state": model_state}, axis_name
    )
    model_state = seen["model_state"]
    own = {"virtual_replica_loss": every, **({} if check is None else {"recompute": check})}
    if set(own) & set(aux):
        raise ValueError(
            f"jdp.strategies.exact: aux keys {sorted(set(own) & set(aux))} are reserved for exact "
            "mode's own metrics; rename them."
        )
    return Reduced(grads, loss, mine, model_state, {**aux, **own})


def _shared_scalars(
    outs: Contribution, weights: jax.Array, weighted: bool, axis_name: str
) -> tuple[dict[str, Any], jax.Array]:
    """One all_gather of every scalar the devices share: ``(their sums, every replica's loss)``.

    The sums are the weight, the loss total and each aux total; the losses
    are ``(G,)``, in virtual-replica order.
    """
    zero = (lambda x, w: jnp.where(w > 0, x, jnp.zeros_like(x))) if weighted else (lambda x, w: x)
    totals = jax.vmap(zero)(outs.total, weights)
    own_losses = safe_divide(totals, weights) if weighted else totals
    scalars = {
        "weight": tree_sum(weights),
        "total": tree_sum(totals),
        "aux": {
            k: tree_sum(jax.vmap(zero)(v * _expand(weights, v), weights))
            for k, v in outs.aux.items()
        },
    }
    packed, unpack = ravel_pytree(scalars)
    gathered = lax.all_gather(jnp.concatenate([packed, own_losses]), axis_name)
    return unpack(tree_sum(gathered[:, : packed.size])), gathered[:, packed.size :].reshape(-1)


def _this_devices_virtual_replicas(
    forward: Forward,
    state: TrainState,
    batch: PyTree,
    rng: jax.Array | None,
    virtual_replicas: int,
    axis_name: str,
    recompute_every: int | None = None,
    fault: jax.Array | None = None,
):
    """``(contributions, check)``: this device's virtual replicas' contributions, stacked,
    and the ``recompute`` metric (None without ``recompute_every``); keys by global index."""
    n = lax.axis_size(axis_name)
    micro = _virtual_replicas_here(batch, virtual_replicas, n)
    per_device = virtual_replicas // n
    first = lax.axis_index(axis_name) * per_device
    index = first + jnp.arange(per_device, dtype=jnp.int32)
    key_index = lambda j: first + j  # noqa: E731
    extra = None
    due = _schedule.due("recompute")
    if recompute_every is not None and due is not False:
        extra = recompute_plan(state.step, recompute_every, micro, per_device, axis_name, due)
        micro = jax.tree.map(lambda x, e: jnp.concatenate([x, e]), micro, extra.micro)
        index = jnp.concatenate([index, extra.virtual_replicas])
        theirs = extra.virtual_replicas
        # Rows past this device's own hold its neighbours' virtual replicas.
        key_index = lambda j: jnp.where(  # noqa: E731
            j < per_device, first + j, theirs[jnp.clip(j - per_device, 0, 1)]
        )
    buffers, run = _each_virtual_replica(
        axis_name,
        lambda j, micro_batch: forward(
            state,
            state.params,
            state.model_state,
            micro_batch,
            # ``first + j`` for a device's own rows, as written before the check
            # existed: a gather from an index array there changed a transformer's
            # bits at n = 1 against n = 8 on JAX 0.10.0.
            None if rng is None else jax.random.fold_in(rng, key_index(j)),
        ),
        micro,
        opaque_zero=(state.step < 0).astype(jnp.int32),
    )
    flip = functools.partial(_flip, index=index, fault=fault, state=state, axis_name=axis_name)
    if extra is None:
        own = jax.tree.map(lambda b: b[:per_device], run(buffers, 0, per_device))
        skipped = None if recompute_every is None else recompute_skipped(state.step)
        return flip(own, first=per_device), skipped
    buffers = run(buffers, 0, per_device + extra.checked.astype(jnp.int32))
    # A fault is transient: it hits a device's first computation of a virtual replica only.
    buffers = flip(buffers, first=per_device + (n > 1))

    def arbitrate(buffers: PyTree, failed: jax.Array) -> PyTree:
        third = run(buffers, per_device + 1, per_device + 1 + failed.astype(jnp.int32))
        return flip(third, first=per_device + 2, after=per_device + 1 + (n <= 2))

    buffers, metric = recompute_check(extra, buffers, arbitrate, per_device, axis_name)
    return jax.tree.map(lambda b: b[:per_device], buffers), metric


def _flip(buffers, *, index, fault, state, axis_name, first, after=0):
    """``buffers`` with a gradient fault (``jdp.testing.with_faults``) in rows ``after:first``."""
    if fault is None:
        return buffers
    rows = jnp.arange(index.size)
    live = jnp.where((rows >= after) & (rows < first), index, -1)
    return buffers._replace(grads=flip_rows(buffers.grads, live, fault, state.step + 1, axis_name))


def _virtual_replicas_here(batch: PyTree, virtual_replicas: int, n: int) -> PyTree:
    """This device's part of the batch as ``(G / n, B / G, ...)``: its virtual replicas."""
    if virtual_replicas % n:
        raise ValueError(
            f"jdp.strategies.exact: virtual_replicas={virtual_replicas} is not divisible by the {n} devices the "
            "step runs on; use a device count that divides it (or another power of two)."
        )
    per_device = virtual_replicas // n
    size = jax.tree.leaves(batch)[0].shape[0]
    if size % per_device:
        raise ValueError(
            f"jdp.strategies.exact: the global batch of {size * n} examples does not split into "
            f"virtual_replicas={virtual_replicas} micro-batches of equal size; use a batch "
            f"size divisible by {virtual_replicas}."
        )
    return jax.tree.map(lambda x: x.reshape((per_device, size // per_device) + x.shape[1:]), batch)


def _each_virtual_replica(axis_name: str, fn, micro: PyTree, opaque_zero: jax.Array):
    """``(buffers, run)``: ``run(buffers, start, stop)`` puts ``fn(j, micro[j])`` in row j
    of ``buffers``, for each j in ``start:stop``, one at a time.

    A collective over ``axis_name`` in ``fn`` (the loss) is refused: inside
    the loop it would see one virtual replica per device, so the objective
    would change with the device count.

    A loop, never inlined: XLA inlines a loop it can prove runs once, and the
    inlined pass fuses differently (measured: batch-norm variances 1 ulp off
    at n = G; an optimization barrier on the trip count did not prevent it).
    The trip count adds ``opaque_zero``, a zero computed from the input
    (``step < 0``), so XLA cannot prove it. Every ``run`` uses the same
    body, so a row computed in a second loop has the bits of the first.
    Convolutions are rewritten into XLA:CPU's canonical order
    (:mod:`jdp._conv_layout`), which XLA does only outside loops.
    """
    # One trace serves the refusal, the buffers' shapes and every iteration.
    closed, template = jax.make_jaxpr(fn, return_shape=True)(0, jax.tree.map(lambda x: x[0], micro))
    refuse_collectives(closed.jaxpr, axis_name, _refusal)
    structure = jax.tree.structure(template)
    count = jax.tree.leaves(micro)[0].shape[0]
    rows = max(count, 2)  # a one-row axis would make the index provably 0
    if count < rows:
        micro = jax.tree.map(lambda x: jnp.concatenate([x] * rows), micro)
    buffers = jax.tree.map(lambda t: jnp.zeros((rows, *t.shape), t.dtype), template)

    def body(j, buffers):
        micro_j = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, j, keepdims=False), micro)
        out = jax.tree.unflatten(
            structure, evaluate_canonical(closed, jax.tree.leaves((j, micro_j)))
        )
        return jax.tree.map(lambda b, o: lax.dynamic_update_index_in_dim(b, o, j, 0), buffers, out)

    def run(buffers: PyTree, start, stop) -> PyTree:
        return lax.fori_loop(start, stop + opaque_zero, body, buffers)

    return buffers, run


def _opaque_update(update: UpdateFn) -> UpdateFn:
    """``update`` run as a loop of one trip that XLA cannot prove, so nothing fuses across it.

    XLA:CPU contracts a multiply and an add into one fused multiply-add
    whenever both land in one fused kernel (always on; no flag turns it off),
    so which operations share a fusion changes the bits. The two backends'
    programs differ around the update (the pmap layout's leading axis adds
    bitcasts at the parameters and outputs), and Adam's update fused with its
    moments under one and not the other (measured: the zoo MLP's params 1 ulp
    apart after one step). Inside the loop body the update is the same
    computation under every backend and device count. The state is the loop's
    carry, so the update still writes in place (the cost: docs/exact.md).
    """

    def opaque(state: TrainState, grads: PyTree, model_state: PyTree, axis_name: str):
        info = jax.eval_shape(
            lambda s, g, m: update(s, g, m, axis_name), state, grads, model_state
        )[1]

        def body(i, carry):
            new = update(carry[0], grads, model_state, axis_name)
            # A second trip (never taken) would keep the first one's result.
            return jax.tree.map(lambda a, b: _select(i == 0, a, b), new, carry)

        trips = 1 + (state.step < 0).astype(jnp.int32)  # XLA cannot prove it is 1
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), info)
        return lax.fori_loop(0, trips, body, (state, zeros))

    return opaque


def _sharded_update(state: TrainState, grads: PyTree, model_state: PyTree, axis_name: str):
    """zero1's update on the whole gradients, each element's arithmetic the unsharded update's.

    The slices are cut before the opaque loop and the parameters gathered
    after it, so the update inside reads arrays of its own, as the unsharded
    update does. Cut inside, the slicing fused into the update's kernel, and
    LLVM contracted some elements' ``p - lr * m`` into a fused multiply-add
    and not others (measured: the zoo CNN's 10-element bias 1 ulp off at
    elements 2, 5 and 8 on 4 devices after 3 steps of SGD with momentum).
    """
    cut, grads = cut_for_update(state, grads, axis_name)
    update = functools.partial(update_cut, like=state.params)
    new, info = _opaque_update(update)(cut, grads, model_state, axis_name)
    return gather_cut(new, state, axis_name), info


def _select(first: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    if _tree.is_prng_key(new):
        data = lax.select(first, jax.random.key_data(new), jax.random.key_data(old))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
    return lax.select(first, new, old)


def _refusal(collective: str) -> str:
    return (
        f"jdp.strategies.exact: the loss calls {collective} over the data axis, which in exact "
        "mode runs once per virtual replica and sees only the virtual replicas the devices hold "
        "at that moment, not the global batch: the objective would change with the device "
        "count. Train this loss with jdp.strategies.data_parallel() (no accumulate_steps), "
        "where a collective in the loss sees the whole global batch, or drop the collective "
        "(e.g. batch norm without axis_name keeps statistics per virtual replica, and is exact)."
    )


def _global_first(stacked: jax.Array, axis_name: str) -> jax.Array:
    """Global virtual replica 0 (device 0's first) on every device: data movement only."""
    if _tree.is_prng_key(stacked):  # an NNX model's RNG state: gather the key data
        data = _global_first(jax.random.key_data(stacked), axis_name)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(stacked))
    return lax.all_gather(stacked[0], axis_name)[0]


def _expand(weights: jax.Array, like: jax.Array) -> jax.Array:
    return weights.reshape(weights.shape + (1,) * (like.ndim - 1))


def _divide(x: jax.Array, total: jax.Array, data_dependent: bool) -> jax.Array:
    """``x / total`` (0 where the total is 0), in a form XLA rewrites alike for every n.

    A data-dependent total multiplies by its reciprocal: where n = 1 the
    division fuses into the optimizer, and XLA reassociates
    ``lr * (S / W)`` there and nowhere else (measured: 1 ulp in the update).
    A constant total (plain losses: G) is divided by directly.
    """
    if not data_dependent:
        return x / total.astype(x.dtype)
    inverse = jnp.where(total > 0, 1 / jnp.where(total > 0, total, 1), 0)
    return x * inverse.astype(x.dtype)


def _floating_model_state(stacked: PyTree, weights: jax.Array, axis_name: str):
    """``(weighted sums of the floating leaves, rebuild(summed, total))``.

    Floating leaves (e.g. batch-norm statistics) become the weight-averaged
    value over every virtual replica; where the total weight is 0, global
    virtual replica 0's value. Other leaves (counters, RNG state) are global
    virtual replica 0's: device 0's first, on every device (each device's own
    first made integer state and all-padding steps diverge by device count).
    """
    leaves, treedef = _tree.flatten(stacked)
    floating = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

    def weighted_sum(x):
        w = _expand(weights, x)
        return tree_sum(jnp.where(w > 0, x * w.astype(x.dtype), jnp.zeros_like(x)))

    sums = [weighted_sum(x) for x, f in zip(leaves, floating, strict=True) if f]

    def rebuild(summed, total):
        it = iter(summed)
        out = [
            jnp.where(total > 0, _divide(next(it), total, True), first) if f else first
            for x, f in zip(leaves, floating, strict=True)
            for first in [_global_first(x, axis_name)]
        ]
        return treedef.unflatten(out)

    return sums, rebuild

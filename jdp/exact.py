"""Exact mode: the same bits on any number of devices.

``make_train_step(..., virtual_replicas=G)`` splits the global batch into G
micro-batches ("virtual replicas") of B/G examples. Each device computes the
gradients of its G/n virtual replicas one at a time, and every sum over
virtual replicas follows one fixed binary tree over the G indices. Every
floating-point operation and its order is then independent of the device
count n, so params, optimizer state and metrics are bitwise equal for any n
that divides G, on one process or several.

What makes it hold on XLA (each measured in the feasibility study, #14):
micro-batches run one at a time in a ``lax.scan`` (batching them with ``vmap``
changes a matmul's rounding); no arithmetic collective is used (``psum``
reduces in an n-dependent order): devices exchange partial sums with
``all_to_all`` and ``all_gather`` only, and the tree is finished in this
module; the program after the last collective is the same for every n.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

from jdp.types import PyTree
from jdp.weighting import safe_divide


class Reduced(NamedTuple):
    """The global result of one exact step, identical on every device."""

    grads: PyTree  # the gradient of the global objective (still loss-scaled)
    loss: jax.Array
    weight: jax.Array | None  # this device's share of the weight, for a WeightedLoss
    model_state: PyTree
    aux: dict[str, jax.Array]
    virtual_replica_loss: jax.Array  # (G,): each virtual replica's own (weighted) mean loss


def check_virtual_replicas(virtual_replicas: int, accumulate_steps: int, grad_reduce: str) -> None:
    """Validates ``virtual_replicas`` when the step is built."""
    g = virtual_replicas
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or g & (g - 1):
        raise ValueError(
            f"make_train_step: virtual_replicas must be a power of two (1, 2, 4, 8, ...), got "
            f"{g!r}: the fixed reduction tree pairs virtual replicas level by level, and "
            "only power-of-two blocks line up with it for every device count."
        )
    if accumulate_steps != 1:
        raise ValueError(
            "make_train_step: virtual_replicas already splits the batch into micro-batches; "
            f"leave accumulate_steps at 1 (got {accumulate_steps})."
        )
    if grad_reduce != "mean":
        raise ValueError(
            "make_train_step: virtual_replicas gives the exact global mean; "
            f"grad_reduce={grad_reduce!r} is not supported with it."
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


def run(forward, state, batch: PyTree, rng, virtual_replicas: int, axis_name: str) -> Reduced:
    """This step's exact global gradient, loss, model state and aux.

    Args:
      forward: ``(state, params, model_state, micro_batch, rng) -> Local``,
        the step's forward and backward pass for one micro-batch.
      state: the step's input state.
      batch: this device's part of the global batch.
      rng: the step's base key (``fold_in(state.rng, state.step)``) or None;
        each virtual replica folds in its global index.
      virtual_replicas: G.
      axis_name: the data axis.
    """
    n = lax.axis_size(axis_name)
    if virtual_replicas % n:
        raise ValueError(
            f"virtual_replicas={virtual_replicas} is not divisible by the {n} devices the "
            "step runs on; use a device count that divides it (or another power of two)."
        )
    per_device = virtual_replicas // n
    size = jax.tree.leaves(batch)[0].shape[0]
    if size % per_device:
        raise ValueError(
            f"The global batch of {size * n} examples does not split into "
            f"virtual_replicas={virtual_replicas} micro-batches of equal size; use a batch "
            f"size divisible by {virtual_replicas}."
        )
    micro = jax.tree.map(lambda x: x.reshape((per_device, size // per_device) + x.shape[1:]), batch)
    first = lax.axis_index(axis_name) * per_device

    outs = _each_virtual_replica(
        lambda j, micro_batch: forward(
            state,
            state.params,
            state.model_state,
            micro_batch,
            None if rng is None else jax.random.fold_in(rng, first + j),
        ),
        micro,
        per_device,
        opaque_zero=(state.step < 0).astype(jnp.int32),
    )
    weighted = outs.weight is not None
    weights = outs.weight if weighted else jnp.ones((per_device,), jnp.float32)
    zero = (lambda x, w: jnp.where(w > 0, x, jnp.zeros_like(x))) if weighted else (lambda x, w: x)
    totals = jax.vmap(zero)(outs.total, weights)
    own_losses = safe_divide(totals, weights) if weighted else totals
    # Two collectives in all, whatever the model: one small all_gather of
    # every scalar the devices share, and one all_to_all + all_gather of the
    # gradients and floating model state, packed into a single vector.
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
    shared = unpack(tree_sum(gathered[:, : packed.size]))
    every = gathered[:, packed.size :].reshape(-1)  # (G,), in virtual-replica order
    # A plain loss divides by the constant G on every device count: a total
    # computed through collectives would be a constant only where n = 1 (XLA
    # drops one-device collectives), and folding it there changes the bits.
    total_weight = shared["weight"] if weighted else jnp.float32(virtual_replicas)
    floating, rebuild = _floating_model_state(outs.model_state, weights)
    vector, unravel = ravel_pytree({"grads": jax.tree.map(tree_sum, outs.grads), "state": floating})
    summed = unravel(exact_sum(vector, axis_name, n))
    grads = jax.tree.map(lambda g: _divide(g, total_weight, weighted), summed["grads"])
    model_state = rebuild(summed["state"], total_weight)
    loss = safe_divide(shared["total"], total_weight)
    aux = {name: safe_divide(v, total_weight) for name, v in shared["aux"].items()}
    # ``weight`` stays per device (this device's share), as in the ordinary
    # step, so summing it over devices gives the global weight.
    mine = scalars["weight"] if weighted else None
    return Reduced(grads, loss, mine, model_state, aux, every)


def _each_virtual_replica(fn, micro: PyTree, count: int, opaque_zero: jax.Array):
    """``fn(j, micro[j])`` for each j, one at a time, outputs stacked.

    A loop, never inlined: XLA inlines a loop it can prove runs once, and the
    inlined pass fuses differently (measured: batch-norm variances 1 ulp off
    at n = G; an optimization barrier on the trip count did not prevent it).
    The trip count adds ``opaque_zero``, a zero computed from the input
    (``step < 0``), so XLA cannot prove it.
    """
    template = jax.eval_shape(fn, 0, jax.tree.map(lambda x: x[0], micro))
    rows = max(count, 2)  # a one-row axis would make the index provably 0
    if count < rows:
        micro = jax.tree.map(lambda x: jnp.concatenate([x] * rows), micro)
    buffers = jax.tree.map(lambda t: jnp.zeros((rows, *t.shape), t.dtype), template)

    def body(j, buffers):
        out = fn(j, jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, j, keepdims=False), micro))
        return jax.tree.map(lambda b, o: lax.dynamic_update_index_in_dim(b, o, j, 0), buffers, out)

    buffers = lax.fori_loop(0, count + opaque_zero, body, buffers)
    return jax.tree.map(lambda b: b[:count], buffers)


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


def _floating_model_state(stacked: PyTree, weights: jax.Array):
    """``(weighted sums of the floating leaves, rebuild(summed, total))``.

    Floating leaves (e.g. batch-norm statistics) become the weight-averaged
    value over every virtual replica; where the total weight is 0, virtual
    replica 0's value. Other leaves (counters, RNG state) are virtual replica
    0's.
    """
    leaves, treedef = jax.tree.flatten(stacked)
    floating = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

    def weighted_sum(x):
        w = _expand(weights, x)
        return tree_sum(jnp.where(w > 0, x * w.astype(x.dtype), jnp.zeros_like(x)))

    sums = [weighted_sum(x) for x, f in zip(leaves, floating, strict=True) if f]

    def rebuild(summed, total):
        it = iter(summed)
        out = [
            jnp.where(total > 0, _divide(next(it), total, True), x[0]) if f else x[0]
            for x, f in zip(leaves, floating, strict=True)
        ]
        return treedef.unflatten(out)

    return sums, rebuild


def check_exact(
    make_step: Callable[[], Callable],
    state: PyTree,
    batches: Sequence[PyTree],
    *,
    device_counts: Sequence[int] = (1, 2, 4, 8),
    backend: str = "pmap",
    devices: Sequence[jax.Device] | None = None,
) -> dict[int, Any]:
    """Runs a few steps at several device counts and checks the bits agree.

    A self-check for your model, hardware and XLA version: exact mode's
    guarantee rests on how XLA compiles the step, so check it where you run.

    Args:
      make_step: builds the per-replica step, e.g.
        ``lambda: jdp.make_train_step(loss_fn, virtual_replicas=8)``.
      state: the initial (unreplicated) state.
      batches: global host batches to train on.
      device_counts: the device counts to compare (subsets of ``devices``).
      backend: ``"pmap"`` or ``"shard_map"``.
      devices: default ``jax.local_devices()``.

    Returns:
      ``{n: (final state, last metrics)}`` as host values (device 0's
      metrics, which in exact mode are the global values; ``weight``, each
      device's own share, is left out).

    Raises:
      AssertionError: naming the first leaf (of the state or the metrics)
        that differs between device counts, the counts and the largest
        difference.
    """
    from jdp.parallel import pmap, shard_map

    devices = list(devices or jax.local_devices())
    results = {}
    for n in device_counts:
        if backend == "pmap":
            step = pmap(make_step(), devices=devices[:n])
        else:
            step = shard_map(
                make_step(), mesh=jax.sharding.Mesh(np.asarray(devices[:n]), ("batch",))
            )
        placed = step.replicate(state)
        metrics = {}
        for batch in batches:
            placed, metrics = step(placed, step.shard(batch))
        # Device 0's metrics; "weight" is each device's own share, so it is left out.
        first = {name: m[0] for name, m in metrics.items() if name != "weight"}
        host = jax.device_get((step.unreplicate(placed), first))
        results[n] = host
    reference = device_counts[0]
    for n in device_counts[1:]:
        _assert_bitwise(results[reference], results[n], reference, n)
    return results


def _assert_bitwise(a, b, n_a: int, n_b: int) -> None:
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    for (path, x), y in zip(flat_a, flat_b, strict=True):
        x, y = _data(x), _data(y)
        if not np.array_equal(x, y, equal_nan=np.asarray(x).dtype.kind == "f"):
            name = jax.tree_util.keystr(path)
            diff = np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
            raise AssertionError(
                f"Exact mode broke: {name} differs between {n_a} and {n_b} devices by up to "
                f"{diff:.3g}. The guarantee depends on how XLA compiles the step: report the "
                "model, the JAX version and the backend."
            )


def _data(x):
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)

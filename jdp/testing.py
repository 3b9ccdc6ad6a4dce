"""Harnesses for checking jdp's guarantees on your own model and machine."""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from jdp._backends import PmapStep, ShardMapStep, pmap, shard_map
from jdp._steps import TrainStep
from jdp._tree import PyTree, is_prng_key


def check_exact(
    make_step: Callable[[], TrainStep],
    state: PyTree,
    batches: Sequence[PyTree],
    *,
    device_counts: Sequence[int] = (1, 2, 4, 8),
    backend: Literal["pmap", "shard_map"] = "pmap",
    devices: Sequence[jax.Device] | None = None,
) -> dict[int, Any]:
    """Runs a few steps at several device counts and checks the bits agree.

    A self-check for your model, hardware and XLA version: exact mode's
    guarantee rests on how XLA compiles the step, so check it where you run.

    Args:
      make_step: builds the per-replica step, e.g.
        ``lambda: jdp.make_train_step(loss_fn, strategy=jdp.strategies.exact(8))``.
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

    devices = list(devices or jax.local_devices())
    results: dict[int, Any] = {}
    for n in device_counts:
        step: PmapStep | ShardMapStep
        if backend == "pmap":
            step = pmap(make_step(), devices=devices[:n])
        else:
            step = shard_map(
                make_step(), mesh=jax.sharding.Mesh(np.asarray(devices[:n]), ("batch",))
            )
        placed = step.replicate(state)
        metrics: dict[str, Any] = {}
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


def _data(x: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if is_prng_key(x) else x)

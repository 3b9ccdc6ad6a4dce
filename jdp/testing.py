"""Harnesses for checking jdp's guarantees on your own model and machine.

:func:`check_exact` checks exact mode; :func:`with_faults`, :class:`Fault`
and :func:`no_fault` inject silent data corruption (testing only) to check
that :class:`jdp.Audit`, exact mode's ``recompute_every`` and the
fingerprints catch it.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jdp._faults import Fault, no_fault, with_faults
from jdp._replication import assert_replicas_in_sync
from jdp._steps import TrainStep
from jdp._tree import PyTree, is_prng_key
from jdp.backends import BACKENDS, Backend, pmap, shard_map

__all__ = ["Fault", "check_exact", "no_fault", "with_faults"]


def check_exact(
    make_step: Callable[[], TrainStep],
    state: PyTree,
    batches: Sequence[PyTree],
    *,
    device_counts: Sequence[int] = (1, 2, 4, 8),
    backend: Callable[..., Backend[Any]] = shard_map,
    devices: Sequence[jax.Device] | None = None,
) -> dict[int, Any]:
    """Runs a few steps at several device counts and checks the bits agree.

    A self-check for your model, hardware and XLA version: exact mode's
    guarantee rests on how XLA compiles the step, so check it where you run.
    After every step, every replica of every device count is compared with
    replica 0 (a replica that drifts is named the step it happens); at the
    end, every device count's state and metrics with the first count's.

    Args:
      make_step: builds the per-replica step, e.g.
        ``lambda: jdp.make_train_step(loss_fn, strategy=jdp.strategies.exact(8))``.
      state: the initial (unreplicated) state.
      batches: global host batches to train on (at least one).
      device_counts: the device counts to compare, each between 1 and the
        number of ``devices``.
      backend: :func:`jdp.shard_map` or :func:`jdp.pmap`.
      devices: default ``jax.local_devices()``.

    Returns:
      ``{n: (final state, last metrics)}`` as host values (device 0's
      metrics, which in exact mode are the global values; ``weight``, each
      device's own share, is left out).

    Raises:
      AssertionError: naming the first leaf (of the state or the metrics)
        that differs between device counts or between the replicas of one
        count, the counts or the replica, and the largest difference.
      ValueError: a device count this machine cannot run, no batches, or a
        step that is not in exact mode.
    """
    devices = list(devices or jax.local_devices())
    _check_arguments(make_step, batches, device_counts, backend, len(devices))
    results: dict[int, Any] = {}
    for n in device_counts:
        results[n] = _run(make_step, state, batches, backend, devices[:n])
    reference = device_counts[0]
    for n in device_counts[1:]:
        _assert_bitwise(results[reference], results[n], reference, n)
    return results


def _check_arguments(make_step, batches, device_counts, backend, available: int) -> None:
    if not callable(make_step):
        raise TypeError(
            "jdp.check_exact: make_step must be a function that builds the step, e.g. "
            "lambda: jdp.make_train_step(loss_fn, strategy=jdp.strategies.exact(8)), got "
            f"{type(make_step).__name__}."
        )
    if backend not in BACKENDS:
        raise TypeError(
            f"jdp.check_exact: backend must be jdp.shard_map or jdp.pmap (the function), got {backend!r}."
        )
    counts = list(device_counts)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) for n in counts):
        raise TypeError(
            f"jdp.check_exact: device_counts must be a sequence of ints, got {device_counts!r}."
        )
    if any(not 1 <= n <= available for n in counts):
        raise ValueError(
            f"jdp.check_exact: device_counts={tuple(counts)} but {available} devices are here; "
            f"each count must be between 1 and {available} (e.g. jdp.force_cpu_devices(8) "
            "before JAX starts, on a CPU)."
        )
    if len(batches) == 0:
        raise ValueError("jdp.check_exact: batches is empty; pass at least one global batch.")
    step = make_step()
    strategy = getattr(step, "strategy", None)
    if not isinstance(step, TrainStep) or strategy is None or strategy.name != "exact":
        name = strategy.name if strategy is not None else type(step).__name__
        raise ValueError(
            f"jdp.check_exact: the step is not in exact mode (its strategy is {name}); only "
            "exact mode promises the same bits on every device count. Build it with "
            "jdp.make_train_step(loss, strategy=jdp.strategies.exact(G))."
        )


def _run(make_step, state, batches, backend, devices) -> Any:
    n = len(devices)
    if backend is pmap:
        step = pmap(make_step(), devices=devices)
    else:
        step = shard_map(make_step(), mesh=jax.sharding.Mesh(np.asarray(devices), ("batch",)))
    placed = step.replicate(state)
    metrics: dict[str, Any] = {}
    for i, batch in enumerate(batches):
        placed, metrics = step(placed, step.shard(batch))
        try:
            assert_replicas_in_sync(placed)
        except AssertionError as e:
            raise AssertionError(
                f"jdp.check_exact: exact mode broke on {n} devices after step {i + 1}: {e}"
            ) from None
    # Device 0's metrics; "weight" is each device's own share, so it is left out.
    first = {name: m[0] for name, m in metrics.items() if name != "weight"}
    return jax.device_get((step.unreplicate(placed), first))


def _assert_bitwise(a, b, n_a: int, n_b: int) -> None:
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    for (path, x), y in zip(flat_a, flat_b, strict=True):
        x, y = _data(x), _data(y)
        if not np.array_equal(x, y, equal_nan=np.asarray(x).dtype.kind == "f"):
            name = jax.tree_util.keystr(path)
            diff = np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
            raise AssertionError(
                f"jdp.check_exact: exact mode broke: {name} differs between {n_a} and {n_b} devices by up to "
                f"{diff:.3g}. The guarantee depends on how XLA compiles the step: report the "
                "model, the JAX version and the backend."
            )


def _data(x: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if is_prng_key(x) else x)

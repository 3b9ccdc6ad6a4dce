"""BatchIterator, prefetch_to_device, masked steps and exact evaluation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models


def dataset(size=100):
    return {"x": np.arange(size * 2, dtype=np.float32).reshape(size, 2), "id": np.arange(size)}


def take(it, k):
    return [next(it) for _ in range(k)]


def test_same_seed_same_batches_and_each_epoch_reshuffles():
    a, b = jdp.BatchIterator(dataset(), 16, seed=3), jdp.BatchIterator(dataset(), 16, seed=3)
    first, second = take(a, 12), take(b, 12)
    for x, y in zip(first, second, strict=True):
        np.testing.assert_array_equal(x["id"], y["id"])
    # 100 // 16 = 6 batches per epoch; epochs are different permutations.
    assert not np.array_equal(first[0]["id"], first[6]["id"])
    for epoch in (first[:6], first[6:]):
        ids = np.concatenate([batch["id"] for batch in epoch])
        assert len(np.unique(ids)) == 96  # no example twice within an epoch


def test_other_seed_other_order():
    a, b = jdp.BatchIterator(dataset(), 16, seed=0), jdp.BatchIterator(dataset(), 16, seed=1)
    assert not np.array_equal(next(a)["id"], next(b)["id"])


def test_epoch_counters_follow_chainer():
    it = jdp.BatchIterator(dataset(40), 16)  # 2 batches per epoch, 8 dropped
    seen = []
    for _ in range(5):
        next(it)
        seen.append((it.epoch, it.is_new_epoch, it.iteration))
    assert seen == [(0, False, 1), (1, True, 2), (1, False, 3), (2, True, 4), (2, False, 5)]


def test_pad_covers_every_example_once_with_a_mask():
    it = jdp.BatchIterator(dataset(100), 16, shuffle=False, remainder="pad", repeat=False)
    batches = list(it)
    assert len(batches) == 7 and all(b["x"].shape == (16, 2) for b in batches)
    ids = np.concatenate([b["id"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(ids, np.arange(100))
    assert batches[-1]["mask"].tolist() == [True] * 4 + [False] * 12
    assert batches[-1]["x"][4:].sum() == 0


def test_resume_mid_epoch_gives_the_same_batches():
    straight = jdp.BatchIterator(dataset(), 16, seed=5)
    expected = take(straight, 15)
    first = jdp.BatchIterator(dataset(), 16, seed=5)
    take(first, 8)
    resumed = jdp.BatchIterator(dataset(), 16, seed=5)
    resumed.set_state(first.get_state())
    for got, want in zip(take(resumed, 7), expected[8:], strict=True):
        np.testing.assert_array_equal(got["id"], want["id"])
    assert resumed.epoch == 2 and resumed.iteration == 15


def test_set_state_from_another_iterator_is_rejected():
    state = jdp.BatchIterator(dataset(), 16, seed=5).get_state()
    with pytest.raises(ValueError, match="saved seed=5 but this iterator has seed=6"):
        jdp.BatchIterator(dataset(), 16, seed=6).set_state(state)


def test_process_slices_are_disjoint_and_cover_the_global_batch():
    whole = take(jdp.BatchIterator(dataset(), 32, seed=2, num_devices=4), 4)
    parts = [
        take(
            jdp.BatchIterator(
                dataset(), 32, seed=2, num_devices=4, process_index=i, process_count=2
            ),
            4,
        )
        for i in range(2)
    ]
    for k in range(4):
        np.testing.assert_array_equal(
            np.concatenate([parts[0][k]["id"], parts[1][k]["id"]]), whole[k]["id"]
        )


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"data": {"x": np.zeros(10), "y": np.zeros(9)}},
            ValueError,
            r"\['x'\] has 10 .* \['y'\] has 9",
        ),
        ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1, got 0"),
        ({"batch_size": 12}, ValueError, "batch_size=12 is not divisible by the 8 devices"),
        ({"batch_size": 8.0}, TypeError, "batch_size must be an int"),
        ({"data": np.zeros((10, 2)), "remainder": "pad"}, ValueError, "data must be a dict"),
        ({"remainder": "keep"}, ValueError, r"remainder must be one of \('drop', 'pad'\)"),
        ({"batch_size": 128}, ValueError, "100 examples make no full batch of 128"),
    ],
)
def test_bad_input(kwargs, error, message):
    args = {"data": dataset(), "batch_size": 16, **kwargs}
    with pytest.raises(error, match=message):
        jdp.BatchIterator(args.pop("data"), args.pop("batch_size"), **args)


def test_prefetch_yields_the_same_batches_in_order(backend):
    step = models.backend(backend, lambda s, b: (s, {}), 8)
    host = take(jdp.BatchIterator(dataset(), 16, seed=1), 5)
    placed = list(jdp.prefetch_to_device(iter(host), size=3, shard_fn=step.shard))
    assert len(placed) == 5
    for got, want in zip(placed, host, strict=True):
        assert isinstance(got["x"], jax.Array)
        np.testing.assert_array_equal(np.asarray(got["id"]).reshape(-1), want["id"])


def test_prefetch_rejects_bad_size():
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        next(jdp.prefetch_to_device([], size=0))


def _metric_fn(params, batch):
    pred = batch["x"] @ params["w"]
    return {
        "error": jdp.weighted_mean(jnp.abs(pred - batch["y"]), batch["mask"]),
        "positive": jdp.weighted_mean(pred > 0, batch["mask"]),
        "all_rows": jnp.ones_like(pred),  # per-example values: padding counts
    }


def test_evaluation_counts_every_example_once(backend):
    r = np.random.RandomState(0)
    test = {"x": r.randn(357, 3).astype(np.float32), "y": r.randn(357).astype(np.float32)}
    params = {"w": jnp.asarray(r.randn(3), jnp.float32)}
    eval_step = models.backend(backend, jdp.make_eval_step(_metric_fn), 8)
    state = eval_step.replicate(jdp.TrainState.create(params=params, tx=optax.sgd(0.1)))
    batches = jdp.BatchIterator(test, 64, shuffle=False, remainder="pad", repeat=False)
    metrics = jdp.evaluate(eval_step, state, batches)
    jdp.assert_replicas_in_sync(state)  # evaluation does not consume the state
    pred = test["x"].astype(np.float64) @ np.asarray(params["w"], np.float64)
    assert metrics["weights"] == {"error": 357.0, "positive": 357.0, "all_rows": 384.0}
    assert metrics["all_rows"] == 1.0
    assert metrics["error"] == pytest.approx(np.mean(np.abs(pred - test["y"])), rel=1e-6)
    assert metrics["positive"] == pytest.approx(np.mean(pred > 0), rel=1e-6)


def test_eval_metrics_must_be_per_example():
    eval_step = jdp.pmap(jdp.make_eval_step(lambda p, b: {"mean": jnp.mean(b["x"])}))
    state = eval_step.replicate(jdp.TrainState.create(params={}, tx=optax.sgd(0.1)))
    with pytest.raises(
        ValueError, match=r"'mean' must have one value per example, shape \(2,\), or be a "
    ):
        eval_step(state, eval_step.shard({"x": np.zeros(16)}))

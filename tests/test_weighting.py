"""Weighted losses: the update is the gradient of sum(totals) / sum(weights).

Every comparison is against plain single-device training on the global batch
with the global objective written out by hand (a token mean, a mean over real
examples), never against another jdp code path.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

B, T, D, H, OUT = 32, 6, 5, 8, 3
STEPS = 4


def token_params(seed=0):
    r = np.random.RandomState(seed)
    return {
        "w": jnp.asarray(r.randn(D, H) / np.sqrt(D), jnp.float32),
        "v": jnp.asarray(r.randn(H, OUT) / np.sqrt(H), jnp.float32),
    }


def token_batch(seed):
    """Sequences whose lengths differ wildly: blocks of 4 examples of length 0."""
    r = np.random.RandomState(seed)
    lengths = r.randint(1, T + 1, size=B)
    lengths[:4] = 0  # replica 0 at n = 8 holds only padding
    lengths[12:16] = 0  # and replica 3
    lengths[16:20] = T  # replica 4 is long
    return {
        "x": r.randn(B, T, D).astype(np.float32),
        "y": r.randn(B, T, OUT).astype(np.float32),
        "mask": np.arange(T)[None, :] < lengths[:, None],
    }


def per_token(params, batch):
    pred = jnp.tanh(batch["x"] @ params["w"]) @ params["v"]
    return jnp.sum((pred - batch["y"]) ** 2, axis=-1)


def token_loss(params, batch):
    return jdp.weighted_mean(per_token(params, batch), batch["mask"])


def global_token_mean(params, batch):
    """The reference objective, written out: the mean over every real token."""
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(per_token(params, batch) * mask) / jnp.sum(mask)


def run(step_fn, state, data, backend, n):
    return models.train_parallel(step_fn, state, data, backend, n)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_token_loss_equals_single_device_token_mean(n, accumulate, backend):
    tx = optax.adam(1e-2)
    data = [token_batch(10 + i) for i in range(STEPS)]
    expected, _ = models.train_single_device(global_token_mean, token_params(), tx, data)
    state = jdp.TrainState.create(params=token_params(), tx=tx)
    step = jdp.make_train_step(
        token_loss, strategy=jdp.strategies.data_parallel(accumulate_steps=accumulate)
    )
    final, metrics = run(step, state, data, backend, n)
    models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-7)
    # The global loss from the per-replica metrics, weighted by the step's own
    # weights, is the reference's loss before its last step.
    before, _ = models.train_single_device(global_token_mean, token_params(), tx, data[:-1])
    loss, weight = np.asarray(metrics["loss"]), np.asarray(metrics["weight"])
    np.testing.assert_allclose(
        np.sum(loss * weight) / np.sum(weight),
        global_token_mean(before, data[-1]),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        weight, data[-1]["mask"].reshape(n, -1).sum(axis=1).astype(np.float32)
    )


def test_example_weighting_is_not_token_weighting():
    """The measured bug: weighting replicas by examples gives another objective."""
    batch = token_batch(3)
    params = token_params()
    shards = [jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch) for i in range(8)]
    real = [s for s in shards if s["mask"].any()]
    by_examples = np.mean([float(token_loss(params, s).mean()) for s in real])
    assert abs(by_examples - float(global_token_mean(params, batch))) > 1e-3


def test_weightless_replica_with_nan_contributes_nothing(backend):
    data = [token_batch(20 + i) for i in range(2)]
    poisoned = []
    for batch in data:
        x = batch["x"].copy()
        x[:4] = np.nan  # replica 0 at n = 8: weight 0, loss NaN
        poisoned.append({**batch, "x": x})
    tx = optax.sgd(0.1)
    clean = [jax.tree.map(lambda v: v[4:], batch) for batch in data]
    expected, _ = models.train_single_device(global_token_mean, token_params(), tx, clean)
    for accumulate in (1, 2):
        step = jdp.make_train_step(
            token_loss, strategy=jdp.strategies.data_parallel(accumulate_steps=accumulate)
        )
        final, metrics = run(
            step, jdp.TrainState.create(params=token_params(), tx=tx), poisoned, backend, 8
        )
        models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-7)
        assert float(metrics["loss"][0]) == 0.0 and float(metrics["weight"][0]) == 0.0


def test_every_replica_weightless_leaves_params_alone(backend):
    batch = {**token_batch(5), "mask": np.zeros((B, T), bool)}
    state = jdp.TrainState.create(params=token_params(), tx=optax.sgd(0.1))
    final, metrics = run(jdp.make_train_step(token_loss), state, [batch], backend, 8)
    models.assert_trees_close(final.params, token_params(), rtol=0, atol=0)
    assert np.all(np.asarray(metrics["loss"]) == 0)


def test_sum_reduction_sums_per_replica_weighted_means(backend):
    batch = token_batch(7)
    params = token_params()
    state = jdp.TrainState.create(params=params, tx=optax.sgd(1.0))
    final, _ = run(
        jdp.make_train_step(token_loss, strategy=jdp.strategies.data_parallel(reduce="sum")),
        state,
        [batch],
        backend,
        8,
    )
    shards = [jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch) for i in range(8)]
    grads = [jax.grad(global_token_mean)(params, s) if s["mask"].any() else None for s in shards]
    summed = jax.tree.map(lambda *g: sum(g), *[g for g in grads if g is not None])
    delta = jax.tree.map(jnp.subtract, params, final.params)
    models.assert_trees_close(delta, summed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_per_example_mask_and_weighted_aux(accumulate, backend):
    def loss_fn(params, batch):
        err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jdp.weighted_mean(err, batch["real"]), {"abs_y": jnp.mean(jnp.abs(batch["y"]))}

    def reference(params, batch):
        err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["real"]) / jnp.sum(batch["real"])

    data = []
    for i in range(3):
        padded, real = jdp.pad_batch(models.regression_batch(19, seed=40 + i), 32)
        data.append({**padded, "real": real})
    tx = optax.adam(1e-2)
    expected, _ = models.train_single_device(reference, models.mlp_params(), tx, data)
    state = jdp.TrainState.create(params=models.mlp_params(), tx=tx)
    step = jdp.make_train_step(
        loss_fn, has_aux=True, strategy=jdp.strategies.data_parallel(accumulate_steps=accumulate)
    )
    final, metrics = run(step, state, data, backend, 8)
    models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-7)
    # aux averaged over micro-batches with the loss's weights.
    last = data[-1]
    for r in range(8):
        rows = slice(4 * r, 4 * r + 4)
        per_micro = np.split(np.arange(32)[rows], accumulate)
        w = np.array([last["real"][m].sum() for m in per_micro], np.float64)
        a = np.array([np.abs(last["y"][m]).mean() for m in per_micro])
        want = 0.0 if w.sum() == 0 else np.sum(w * a) / w.sum()
        np.testing.assert_allclose(metrics["abs_y"][r], want, rtol=1e-6, atol=1e-7)


class BNNet(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(2)(nn.relu(x))


def bn_loss(axis_name):
    def loss_fn(params, batch, model_state):
        out, updates = BNNet(axis_name).apply(
            {"params": params, "batch_stats": model_state}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]

    return loss_fn


@pytest.mark.parametrize("n", [2, 8])
def test_sync_batch_norm_equals_single_device_batch_norm(n, backend):
    variables = BNNet().init(jax.random.key(0), jnp.zeros((1, 6)))
    data = [models.regression_batch(32, seed=60 + i, dout=2) for i in range(3)]
    # SGD, not Adam: Adam would blow the ~1e-8 gradient noise of the bias right
    # before batch norm up to full-size steps.
    tx = optax.sgd(0.1)
    expected, _ = models.train_single_device(
        bn_loss(None), variables["params"], tx, data, model_state=variables["batch_stats"]
    )
    state = jdp.TrainState.create(
        params=variables["params"], tx=tx, model_state=variables["batch_stats"]
    )
    step = jdp.make_train_step(bn_loss("batch"), has_model_state=True)
    final, _ = run(step, state, data, backend, n)
    # Per leaf, relative to the largest value in the tree: a bias right before
    # batch norm has a true gradient of ~1e-8.
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(expected))
    models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-5 * scale)
    # Per-replica statistics (no axis_name) are another model: they differ.
    plain, _ = run(
        jdp.make_train_step(bn_loss(None), has_model_state=True), state, data, backend, n
    )
    gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), plain.params, expected)
    assert max(jax.tree.leaves(gaps)) > 1e-3


def test_weightless_replicas_have_no_say_in_model_state(backend):
    def loss_fn(params, batch, model_state):
        mean = jnp.sum(batch["x"] * batch["real"][:, None], axis=0) / jnp.maximum(
            jnp.sum(batch["real"]), 1
        )
        err = jnp.sum((batch["x"] * params) ** 2, axis=-1)
        return jdp.weighted_mean(err, batch["real"]), {"mean": mean}

    padded, real = jdp.pad_batch({"x": np.arange(20 * 3, dtype=np.float32).reshape(20, 3)}, 32)
    batch = {**padded, "real": real}
    state = jdp.TrainState.create(
        params=jnp.ones(3), tx=optax.sgd(0.0), model_state={"mean": jnp.full(3, 99.0)}
    )
    final, _ = run(jdp.make_train_step(loss_fn, has_model_state=True), state, [batch], backend, 8)
    # Replicas 5..7 hold only padding; averaging by weight gives the mean over
    # the 20 real examples (every replica's block has 4 real or 0).
    np.testing.assert_allclose(final.model_state["mean"], padded["x"][:20].mean(axis=0), rtol=1e-6)


def test_bfloat16_compute_leaves_regression_targets_alone(backend):
    """Targets near 1000 in bfloat16 are multiples of 4; the default policy keeps them."""
    r = np.random.RandomState(0)
    x = r.randn(256, 4).astype(np.float32)
    y = (1000.0 + x @ np.array([1.0, 2.0, -1.0, 0.5], np.float32) * 0.7)[:, None]

    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)

    params = {"w": jnp.zeros((4, 1)), "b": jnp.full((1,), 1000.0)}
    tx = optax.sgd(0.05)
    losses = {}
    for name, precision in [
        ("float32", None),
        ("bf16", jdp.Policy(jnp.bfloat16, cast_batch=("x",))),
    ]:
        step = models.backend(backend, jdp.make_train_step(loss_fn, precision=precision), 8)
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        batch = step.shard({"x": x, "y": y})
        for _ in range(60):
            state, metrics = step(state, batch)
        losses[name] = float(np.mean(metrics["loss"]))
    assert losses["float32"] < 0.05  # it learned: the start is ~0.9
    assert losses["bf16"] == pytest.approx(losses["float32"], rel=0.01, abs=2e-3)


def test_policy_selects_batch_leaves_by_name_or_predicate():
    batch = {"image": np.ones((2, 3), np.float32), "target": np.full(2, 1001.0, np.float32)}
    by_name = jdp.Policy(jnp.bfloat16, cast_batch=("image",)).cast_batch_leaves(batch)
    assert by_name["image"].dtype == jnp.bfloat16 and by_name["target"].dtype == np.float32
    by_rule = jdp.Policy(jnp.float16, cast_batch=lambda path, x: x.ndim == 2)
    assert by_rule.cast_batch_leaves(batch)["image"].dtype == jnp.float16
    assert jdp.Policy(jnp.bfloat16).cast_batch_leaves(batch) is batch
    with pytest.raises(ValueError, match=r"no batch leaf is named \['imgae'\]"):
        jdp.Policy(jnp.bfloat16, cast_batch=("imgae",)).cast_batch_leaves(batch)
    with pytest.raises(TypeError, match=r"write cast_batch=\('image',\)"):
        jdp.Policy(jnp.bfloat16, cast_batch="image")
    with pytest.raises(TypeError, match="compute_dtype must be a floating dtype"):
        jdp.Policy(jnp.int8)
    with pytest.raises(TypeError, match="precision must be a jdp.Policy"):
        jdp.make_train_step(models.mlp_loss, precision=jnp.int32)


def test_loss_scale_arithmetic_is_float32():
    scale = jdp.StaticLossScale(65536)
    scaled = scale.scale(jnp.float16(1.0))
    assert scaled.dtype == jnp.float32 and float(scaled) == 65536.0
    tree = jdp.StaticLossScale(1024).unscale({"g": jnp.float16(2048.0), "n": jnp.int32(7)})
    assert tree["g"].dtype == jnp.float16 and float(tree["g"]) == 2.0
    assert tree["n"].dtype == jnp.int32 and int(tree["n"]) == 7
    dyn = jdp.DynamicLossScale(jnp.float32(4.0))
    assert int(dyn.unscale(jnp.int32(7))) == 7


def test_weighted_mean_rules():
    values = jnp.array([[1.0, 2.0], [3.0, jnp.nan]])
    per_token = jdp.weighted_mean(values, jnp.array([[True, True], [True, False]]))
    assert (float(per_token.total), float(per_token.weight)) == (6.0, 3.0)
    per_example = jdp.weighted_mean(values[:1], jnp.array([True]))
    assert (float(per_example.total), float(per_example.weight)) == (3.0, 2.0)
    weights = jdp.weighted_mean(jnp.array([1.0, 5.0]), jnp.array([0.5, 0.0]))
    assert (float(weights.total), float(weights.weight)) == (0.5, 0.5)
    assert float(jdp.WeightedLoss(jnp.float32(jnp.nan), jnp.float32(0)).mean()) == 0.0
    with pytest.raises(ValueError, match=r"mask's shape \(3,\) must be a prefix"):
        jdp.weighted_mean(values, jnp.ones(3, bool))


def test_a_batch_key_named_mask_is_just_data():
    def loss_fn(params, batch):
        # a (B, T) attention-style mask the step must not interpret
        return jnp.mean(jnp.sum(batch["x"] * batch["mask"], axis=-1) * params)

    batch = {"x": np.ones((16, 4), np.float32), "mask": np.ones((16, 4), np.float32)}
    step = jdp.pmap(jdp.make_train_step(loss_fn))
    state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
    state, metrics = step(state, step.shard(batch))
    np.testing.assert_allclose(metrics["loss"], 4.0)
    assert float(step.unreplicate(state).params) == pytest.approx(1.0 - 0.1 * 4.0)

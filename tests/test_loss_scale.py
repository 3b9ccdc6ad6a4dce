"""Loss scales: the dynamic rule, pytree round trips, and one decision for all replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models


def reference_rule(scale, counter, finite, period, factor, min_scale):
    """The documented rule, in plain Python."""
    if finite:
        counter += 1
        if counter == period:
            counter = 0
            if np.isfinite(np.float32(scale * factor)):
                scale = scale * factor
        return scale, counter
    return max(scale / factor, min_scale), 0


SCRIPT = [True, True, True, False, True, False, False, False, True, True, True, True, True, True]


@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_trajectory_follows_the_rule(jit):
    ls = jdp.DynamicLossScale(jnp.float32(8.0), period=3, factor=4, min_loss_scale=0.5)
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    scale, counter = 8.0, 0
    for finite in SCRIPT:
        ls = adjust(ls, jnp.array(finite))
        scale, counter = reference_rule(scale, counter, finite, 3, 4, 0.5)
        assert (float(ls.loss_scale), int(ls.counter)) == (scale, counter)
        assert (ls.period, ls.factor, ls.min_loss_scale) == (3, 4, 0.5)
    assert scale == 8.0  # down to the 0.5 floor after three overflows, then grown twice


def test_growth_that_would_overflow_keeps_the_scale():
    ls = jdp.DynamicLossScale(jnp.float32(2.0**127), period=1).adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2.0**127 and int(ls.counter) == 0


def _fields(ls):
    return {
        "loss_scale": float(ls.loss_scale),
        "counter": int(ls.counter),
        "period": ls.period,
        "factor": ls.factor,
        "min_loss_scale": ls.min_loss_scale,
    }


def custom_scale():
    return jdp.DynamicLossScale(
        jnp.float32(512.0), counter=3, period=7, factor=3, min_loss_scale=4.0
    )


def test_every_field_survives_jit():
    out = jax.jit(lambda s: s)(custom_scale())
    assert _fields(out) == _fields(custom_scale())


def test_every_field_survives_pmap_and_replicate():
    rep = jdp.replicate(custom_scale())
    out = jdp.unreplicate(jax.pmap(lambda s: s)(rep))
    assert _fields(out) == _fields(custom_scale())


def test_every_field_survives_adjust_under_jit_down_to_the_floor():
    ls = custom_scale()
    for _ in range(10):
        ls = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    assert float(ls.loss_scale) == 4.0  # jmp's bug would floor at 1.0 here


def test_static_and_noop_scales():
    s = jdp.StaticLossScale(2.0**10)
    x = {"a": jnp.float32(3.0), "h": jnp.float16(0.5)}
    scaled = s.scale(x)
    # The scale multiplies in float32 (a float16 leaf promotes, as in jmp).
    assert float(scaled["a"]) == 3072.0 and scaled["h"].dtype == jnp.float32
    assert float(s.unscale(scaled)["h"]) == 0.5
    assert jdp.NoOpLossScale().scale(x) is x
    assert float(jax.jit(lambda s: s)(s).loss_scale) == 1024.0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: jdp.StaticLossScale(0.0), "loss_scale must be finite and > 0, got 0.0"),
        (lambda: jdp.DynamicLossScale(-1.0), "loss_scale must be finite and > 0, got -1.0"),
        (lambda: jdp.DynamicLossScale(jnp.inf), "loss_scale must be finite and > 0, got inf"),
        (lambda: jdp.DynamicLossScale(2.0, period=0), "period must be an int >= 1, got 0"),
        (lambda: jdp.DynamicLossScale(2.0, factor=1), "factor must be finite and > 1, got 1"),
        (
            lambda: jdp.DynamicLossScale(2.0, min_loss_scale=0),
            "min_loss_scale must be finite and > 0",
        ),
        (lambda: jdp.DynamicLossScale(2.0, counter=-1), "counter must be >= 0, got -1"),
    ],
)
def test_bad_hyperparameters_are_rejected_when_built(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_all_finite():
    assert bool(jdp.all_finite({"a": jnp.ones(3), "i": jnp.arange(3)}))
    assert not bool(jdp.all_finite({"a": jnp.ones(3), "b": jnp.array([0.0, jnp.nan])}))
    assert bool(jdp.all_finite({}))


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.parametrize("bad_value", [np.inf, np.nan])
def test_overflow_in_one_replica_skips_everywhere_and_changes_nothing(backend, bad_value):
    tx = optax.adam(1e-2)
    state = jdp.TrainState.create(
        params=models.mlp_params(), tx=tx, loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**15))
    )
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    state = step.replicate(state)
    good = models.regression_batch(32, seed=3)
    state, _ = step(state, step.shard(good))
    before = _host(step.unreplicate(state))

    bad = models.regression_batch(32, seed=4)
    bad["x"][13, 2] = bad_value  # example 13 lives on replica 3 only
    state, metrics = step(state, step.shard(bad))
    jdp.assert_replicas_in_sync(state)
    after = _host(step.unreplicate(state))
    for field in ("params", "opt_state", "model_state"):
        jax.tree.map(np.testing.assert_array_equal, getattr(after, field), getattr(before, field))
    assert not np.asarray(metrics["grads_finite"]).any()
    assert float(after.loss_scale.loss_scale) == 2.0**14 and int(after.loss_scale.counter) == 0
    assert int(after.skipped_steps) == 1 and int(after.step) == 2
    assert np.asarray(metrics["skipped_steps"]).tolist() == [1] * 8
    np.testing.assert_array_equal(metrics["loss_scale"], np.full(8, 2.0**15, np.float32))

    # Training goes on: the next finite step is an ordinary Adam step from `before`.
    nxt = models.regression_batch(32, seed=5)
    state, metrics = step(state, step.shard(nxt))
    assert np.asarray(metrics["grads_finite"]).all()
    grads = jax.grad(models.mlp_loss)(before.params, nxt)
    updates, _ = tx.update(grads, before.opt_state, before.params)
    expected = optax.apply_updates(before.params, updates)
    models.assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5, atol=1e-7)


def test_static_scale_in_float32_equals_no_scaling(backend):
    data = [models.regression_batch(32, seed=20 + i) for i in range(5)]
    finals = []
    for loss_scale in (None, jdp.StaticLossScale(1024.0)):
        state = jdp.TrainState.create(
            params=models.mlp_params(), tx=optax.adam(1e-2), loss_scale=loss_scale
        )
        step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
        state = step.replicate(state)
        for batch in data:
            state, _ = step(state, step.shard(batch))
        finals.append(step.unreplicate(state).params)
    models.assert_trees_close(finals[1], finals[0], rtol=1e-6)


def _tiny_loss(params, batch):
    # Errors scaled by 1e-4: in float16 the gradient w.r.t. the scaled error
    # (~4e-5, subnormal) times 1e-4 underflows to zero, as deep in a network.
    pred = batch["x"] @ params["w"]
    return jnp.mean(((pred - batch["y"]) * 1e-4) ** 2)


def _fp32_loss(params, data):
    return float(jnp.mean(jnp.stack([_tiny_loss(params, b) for b in data])))


def test_dynamic_scaling_recovers_float16_gradients():
    r = np.random.RandomState(0)
    true_w = r.randn(8, 1).astype(np.float32)
    data = []
    for _ in range(30):
        x = r.randn(128, 8).astype(np.float32)
        data.append({"x": x, "y": x @ true_w})
    params = {"w": jnp.zeros((8, 1), jnp.float32)}

    def train(compute_dtype, loss_scale):
        precision = compute_dtype and jdp.Policy(compute_dtype, cast_batch=("x", "y"))
        state = jdp.TrainState.create(
            params=params, tx=optax.adam(0.05, eps=1e-12), loss_scale=loss_scale
        )
        step = jdp.pmap(jdp.make_train_step(_tiny_loss, precision=precision))
        state = step.replicate(state)
        for batch in data:
            state, metrics = step(state, step.shard(batch))
        return step.unreplicate(state), metrics

    f32, _ = train(None, None)
    with pytest.warns(UserWarning, match=r"precision=float16\) with no loss scale"):
        f16_plain, _ = train(jnp.float16, None)  # the case the warning names
    f16_scaled, metrics = train(jnp.float16, jdp.DynamicLossScale(jnp.float32(2.0**15)))
    start, ref = _fp32_loss(params, data), _fp32_loss(f32.params, data)
    assert ref < 0.1 * start  # float32 training learns
    assert _fp32_loss(f16_plain.params, data) == pytest.approx(start)  # zero gradients: no progress
    assert _fp32_loss(f16_scaled.params, data) == pytest.approx(ref, rel=0.05)
    assert f16_scaled.params["w"].dtype == jnp.float32
    assert np.asarray(metrics["grads_finite"]).all()


def test_bfloat16_compute_keeps_float32_master_state(backend):
    seen = []

    def loss_fn(params, batch):
        seen.append((params["w1"].dtype, batch["x"].dtype))
        return models.mlp_loss(params, batch)

    params = models.mlp_params()
    batch = models.regression_batch(32)
    state = jdp.TrainState.create(params=params, tx=optax.sgd(1.0))
    policy = jdp.Policy(jnp.bfloat16, cast_batch=("x", "y"))
    step = models.backend(backend, jdp.make_train_step(loss_fn, precision=policy), 8)
    out, metrics = step(step.replicate(state), step.shard(batch))
    out = step.unreplicate(out)
    assert seen[0] == (jnp.bfloat16, jnp.bfloat16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out.params))
    assert metrics["loss"].dtype == jnp.float32

    # Reference: per-shard bfloat16 gradients, averaged in float32, one SGD(1) step.
    def shard_grad(i):
        shard = jax.tree.map(lambda x: x[i * 4 : (i + 1) * 4], batch)
        return jax.grad(
            lambda p: models.mlp_loss(
                *jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), (p, shard))
            ).astype(jnp.float32)
        )(params)

    mean_grad = jax.tree.map(lambda *g: sum(g) / 8, *[shard_grad(i) for i in range(8)])
    expected = jax.tree.map(jnp.subtract, params, mean_grad)
    models.assert_trees_close(out.params, expected, rtol=1e-5, atol=1e-6)


def test_flax_dynamic_scale_equals_period_growth_interval_plus_one():
    """docs/loss-scaling.md's Flax row, checked against Flax itself."""
    from flax.training.dynamic_scale import DynamicScale

    growth_interval = 3
    finite = np.random.default_rng(0).random(300) > 0.1
    flax_scale = DynamicScale(growth_interval=growth_interval, scale=2.0**16, minimum_scale=1.0)
    ours = jdp.DynamicLossScale(jnp.float32(2.0**16), period=growth_interval + 1)
    for ok in finite:
        bad = jnp.float32(0.0 if ok else jnp.inf)
        flax_scale, is_fin, _, _ = flax_scale.value_and_grad(lambda x, b=bad: x * (1.0 + b))(
            jnp.float32(1.0)
        )
        ours = ours.adjust(jnp.asarray(ok))
        assert bool(is_fin) == bool(ok)
        assert float(flax_scale.scale) == float(ours.loss_scale)
    wrong = jdp.DynamicLossScale(jnp.float32(2.0**16), period=growth_interval)
    assert float(
        wrong.adjust(jnp.array(True)).adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale
    ) != float(
        DynamicScale(growth_interval=growth_interval, scale=2.0**16)
        .value_and_grad(lambda x: x)(1.0)[0]
        .value_and_grad(lambda x: x)(1.0)[0]
        .value_and_grad(lambda x: x)(1.0)[0]
        .scale
    )


def test_adjust_refuses_anything_but_one_boolean_decision():
    scale = jdp.DynamicLossScale(jnp.float32(2.0**15))
    with pytest.raises(ValueError, match=r"one boolean scalar .* got shape \(3,\)"):
        scale.adjust(jnp.array([True, False, True]))
    with pytest.raises(ValueError, match="dtype float32"):
        scale.adjust(jnp.float32(1.0))

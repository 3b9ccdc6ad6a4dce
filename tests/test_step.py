"""The per-replica step equals single-device training on the global batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

STEPS = 5
GLOBAL_BATCH = 32


def batches(make, count=STEPS, size=GLOBAL_BATCH):
    return [make(size, seed=10 + i) for i in range(count)]


def train_parallel(step_fn, state, data, backend, n):
    return models.train_parallel(step_fn, state, data, backend, n)


def _mlp():
    return models.mlp_loss, models.mlp_params(), None, models.regression_batch


def _flax_with_bn_and_dropout_off():
    variables = models.classifier_variables()
    return (
        models.classifier_eval_mode_loss,
        variables["params"],
        variables["batch_stats"],
        models.classification_batch,
    )


MODELS = {"mlp": _mlp, "flax": _flax_with_bn_and_dropout_off}


@pytest.mark.parametrize("opt", sorted(models.OPTIMIZERS))
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_equals_single_device_training(model, n, opt, backend):
    loss_fn, params, model_state, make_batch = MODELS[model]()
    tx = models.OPTIMIZERS[opt]()
    data = batches(make_batch)
    expected, _ = models.train_single_device(loss_fn, params, tx, data, model_state=model_state)
    state = jdp.TrainState.create(params=params, tx=tx, model_state=model_state)
    step = jdp.make_train_step(loss_fn, has_model_state=model_state is not None)
    final, metrics = train_parallel(step, state, data, backend, n)
    models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-7)
    assert int(final.step) == STEPS
    # The last step's per-replica losses: each replica's shard under the
    # params the reference held before its last step.
    before, _ = models.train_single_device(loss_fn, params, tx, data[:-1], model_state=model_state)
    extra = () if model_state is None else (model_state,)
    shard = GLOBAL_BATCH // n
    losses = [
        loss_fn(
            before, jax.tree.map(lambda x, i=i: x[i * shard : (i + 1) * shard], data[-1]), *extra
        )
        for i in range(n)
    ]
    losses = [loss[0] if isinstance(loss, tuple) else loss for loss in losses]
    np.testing.assert_allclose(metrics["loss"], np.stack(losses), rtol=1e-5, atol=1e-7)


def test_sum_reduction_is_n_times_the_mean(backend):
    n = 8
    params = models.mlp_params()
    batch = models.regression_batch(GLOBAL_BATCH)
    state = jdp.TrainState.create(params=params, tx=optax.sgd(1.0))
    out = {}
    for reduce in ("mean", "sum"):
        step = jdp.make_train_step(
            models.mlp_loss, strategy=jdp.strategies.data_parallel(reduce=reduce)
        )
        out[reduce], _ = train_parallel(step, state, [batch], backend, n)
    # With SGD(lr=1) the update is minus the aggregated gradient.
    delta = {r: jax.tree.map(jnp.subtract, params, out[r].params) for r in out}
    models.assert_trees_close(delta["sum"], jax.tree.map(lambda g: n * g, delta["mean"]), rtol=1e-5)
    # And the sum is literally the sum of per-shard gradients (the seeds' rule).
    shards = [jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch) for i in range(n)]
    summed = jax.tree.map(
        lambda *g: sum(g), *[jax.grad(models.mlp_loss)(params, s) for s in shards]
    )
    models.assert_trees_close(delta["sum"], summed, rtol=1e-5, atol=1e-7)


def test_accumulation_equals_one_big_step(backend):
    tx = optax.adam(1e-2)
    params = models.mlp_params()
    data = batches(models.regression_batch)
    state = jdp.TrainState.create(params=params, tx=tx)
    one, _ = train_parallel(jdp.make_train_step(models.mlp_loss), state, data, backend, 8)
    four, _ = train_parallel(
        jdp.make_train_step(
            models.mlp_loss, strategy=jdp.strategies.data_parallel(accumulate_steps=4)
        ),
        state,
        data,
        backend,
        8,
    )
    models.assert_trees_close(four.params, one.params, rtol=1e-5, atol=1e-7)


def _per_replica_bn_reference(variables, batch, n, rng_per_replica):
    """Batch stats updated on each shard alone, then averaged: cross-replica BN."""
    stats = []
    for i in range(n):
        shard = jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch)
        _, ms = models.classifier_train_loss(
            variables["params"], shard, variables["batch_stats"], rng_per_replica[i]
        )
        stats.append(ms)
    return jax.tree.map(lambda *s: sum(s) / n, *stats)


def test_model_state_is_averaged_and_rng_is_per_replica(backend):
    n = 8
    variables = models.classifier_variables()
    batch = models.classification_batch(GLOBAL_BATCH)
    key = jax.random.key(42)
    state = jdp.TrainState.create(
        params=variables["params"],
        tx=optax.sgd(0.0),
        model_state=variables["batch_stats"],
        rng=key,
    )
    step = jdp.make_train_step(models.classifier_train_loss, has_model_state=True, has_rng=True)
    final, _ = train_parallel(step, state, [batch], backend, n)
    keys = [jax.random.fold_in(jax.random.fold_in(key, 0), i) for i in range(n)]
    expected = _per_replica_bn_reference(variables, batch, n, keys)
    models.assert_trees_close(final.model_state, expected, rtol=1e-5, atol=1e-7)


def test_replica_keys_are_distinct_and_deterministic(backend):
    def loss_fn(params, batch, rng):
        return jnp.mean(batch * params), {"noise": jax.random.uniform(rng)}

    state = jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1), rng=jax.random.key(7))
    step_fn = jdp.make_train_step(loss_fn, has_aux=True, has_rng=True)
    runs = []
    for _ in range(2):
        step = models.backend(backend, step_fn, 8)
        s = step.replicate(state)
        noises = []
        for _ in range(3):
            s, metrics = step(s, step.shard(np.ones(16, np.float32)))
            noises.append(np.asarray(metrics["noise"]))
        runs.append(np.stack(noises))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert len(np.unique(runs[0])) == 3 * 8
    expected = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 2), 5))
    assert runs[0][2, 5] == np.float32(expected)


def test_aux_metrics_are_per_replica(backend):
    def loss_fn(params, batch):
        loss = jnp.mean((batch - params) ** 2)
        return loss, {"batch_mean": jnp.mean(batch)}

    state = jdp.TrainState.create(params=jnp.zeros(()), tx=optax.sgd(0.1))
    step = models.backend(backend, jdp.make_train_step(loss_fn, has_aux=True), 8)
    batch = np.arange(16, dtype=np.float32)
    _, metrics = step(step.replicate(state), step.shard(batch))
    np.testing.assert_allclose(metrics["batch_mean"], batch.reshape(8, 2).mean(axis=1))
    np.testing.assert_allclose(metrics["loss"], (batch.reshape(8, 2) ** 2).mean(axis=1))
    assert float(jnp.mean(metrics["loss"])) == pytest.approx(float(np.mean(batch**2)))

"""What used to go wrong without a word now says so: consumed states, float16 ranges, divergence."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

DATA = models.regression_batch(64, seed=31)


def state(**kwargs):
    return jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1), **kwargs)


def consumed(backend):
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    old = step.replicate(state())
    step(old, step.shard(DATA))
    return old


def test_a_consumed_state_gets_jdps_message_everywhere(backend, tmp_path):
    old = consumed(backend)
    evaluator = models.backend(
        backend, jdp.make_eval_step(lambda p, b: {"e": jnp.sum(b["x"], -1) * 0}), 8
    )
    match = r"leaf \.step was consumed by an earlier step call: steps donate"
    with pytest.raises(RuntimeError, match="evaluate: " + match):
        jdp.evaluate(evaluator, old, [DATA])
    with jdp.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(RuntimeError, match="Checkpointer.save: " + match):
            ckpt.save(1, old)
        ckpt.save(1, state())
        with pytest.raises(RuntimeError, match=r"Checkpointer.restore \(the template\): " + match):
            ckpt.restore(old)
    with pytest.raises(RuntimeError, match="unreplicate: " + match):
        jdp.unreplicate(old)


@pytest.mark.parametrize("strategy", [jdp.strategies.data_parallel, jdp.strategies.zero1])
def test_float16_communication_without_a_loss_scale_is_refused(strategy):
    comm = jdp.strategies.cast_communication(jnp.float16)
    step = jdp.shard_map(
        jdp.make_train_step(models.mlp_loss, strategy=strategy(communication=comm))
    )
    with pytest.raises(ValueError, match=r"float16 gradient communication without a loss scale"):
        step(step.replicate(state()), step.shard(DATA))


def test_float16_communication_overflow_is_skipped_under_a_dynamic_scale():
    """What the loss scale is for: a sum above 65504 becomes inf, the step is skipped everywhere."""
    comm = jdp.strategies.cast_communication(jnp.float16)
    step = jdp.shard_map(
        jdp.make_train_step(
            models.mlp_loss, strategy=jdp.strategies.data_parallel(communication=comm)
        )
    )
    start = state(loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**15)))
    huge = {"x": DATA["x"] * 1e4, "y": DATA["y"]}
    after, metrics = step(step.replicate(start), step.shard(huge))
    assert not bool(metrics["grads_finite"][0])
    for a, b in zip(
        jax_leaves(step.unreplicate(after).params), jax_leaves(start.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_float16_policy_without_a_loss_scale_warns_once_at_trace_time():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss, precision=jnp.float16))
    placed = step.replicate(state())
    with pytest.warns(UserWarning, match=r"precision=float16\) with no loss scale"):
        placed, _ = step(placed, step.shard(DATA))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(placed, step.shard(DATA))  # traced once: no second warning


def test_fit_warns_once_when_training_diverges(backend):
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    placed = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(1e6)))
    with pytest.warns(
        RuntimeWarning, match=r"the loss is (nan|inf) at step \d+, on a step that was not skipped"
    ) as record:
        jdp.fit(
            step, placed, jdp.BatchIterator(DATA, 32), num_steps=12, log_every=1, progress=False
        )
    assert len([w for w in record if "diverged" in str(w.message)]) == 1


def test_fit_warns_when_every_step_is_skipped():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    bad = {"x": np.full_like(DATA["x"], np.nan), "y": DATA["y"]}
    placed = step.replicate(state(loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**4))))
    with pytest.warns(RuntimeWarning, match=r"every step from 11 to 20 was skipped"):
        jdp.fit(
            step, placed, jdp.BatchIterator(bad, 32), num_steps=20, log_every=10, progress=False
        )


def per_device_init(seed):
    """What ``jax.pmap(init)(keys)`` gives: a pmap-layout state whose replicas differ."""
    keys = jax.random.split(jax.random.key(seed), 8)
    return jax.pmap(lambda k: state(rng=k))(keys)


def test_replicas_that_disagree_are_refused_by_the_step_and_by_fit(backend):
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    match = r"the state's replicas disagree: leaf \.rng on replica 1 differs from replica 0"
    with pytest.raises(ValueError, match=f"^jdp.{backend}: " + match):
        step(per_device_init(0), step.shard(DATA))
    agreed = step.replicate(state(rng=jax.random.key(0)))
    step(agreed, step.shard(DATA))  # the first call checked; later calls cost nothing more
    with pytest.raises(ValueError, match="^jdp.fit: " + match):
        jdp.fit(step, per_device_init(1), [DATA], num_steps=1, progress=False)


def test_replicas_in_agreement_pass_whatever_their_values_or_nans():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), models.mlp_params())
    placed = step.replicate(jdp.TrainState.create(params=nan, tx=optax.sgd(0.1)))
    _, metrics = step(placed, step.shard(DATA))  # NaNs in the same places agree
    assert np.isnan(np.asarray(metrics["loss"])).all()
    fresh = jdp.pmap(jdp.make_train_step(models.mlp_loss))  # its first call checks again
    placed = fresh.replicate(state())
    w = np.asarray(placed.params["w1"]).copy()
    w[5, 0, 0] = np.nextafter(w[5, 0, 0], np.float32(np.inf))  # one ulp, one value, one replica
    one_off = placed.replace(
        params={**placed.params, "w1": jax.device_put(w, placed.params["w1"].sharding)}
    )
    with pytest.raises(ValueError, match=r"leaf \.params\['w1'\] on replica 5 differs"):
        fresh(one_off, fresh.shard(DATA))


def test_a_traced_negative_weight_makes_the_step_nan_not_a_dropped_replica():
    def loss(params, batch):
        per_example = jnp.sum((models.mlp_forward(params, batch) - batch["y"]) ** 2, -1)
        sign = jnp.where(batch["x"][0, 0] > -100.0, -1.0, 1.0)  # traced: -1
        return jdp.WeightedLoss(jnp.sum(per_example), sign * per_example.shape[0])

    step = jdp.shard_map(jdp.make_train_step(loss))
    _, metrics = step(step.replicate(state()), step.shard(DATA))
    assert np.isnan(np.asarray(metrics["loss"])).all()
    scaled = step.replicate(state(loss_scale=jdp.DynamicLossScale(2.0**8)))
    new, metrics = step(scaled, step.shard(DATA))
    assert not np.asarray(metrics["grads_finite"]).any()  # skipped, params unchanged
    models.assert_trees_close(step.unreplicate(new).params, models.mlp_params(), rtol=0)


def test_a_zero1_state_for_four_devices_given_to_eight_says_how_to_replace_it(backend):
    def step_on(n):
        return models.backend(
            backend, jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1()), n
        )

    four, eight = step_on(4), step_on(8)
    adam = jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2))
    placed = four.replicate(adam)
    with pytest.raises(ValueError, match="for 4 devices but this step runs on 8|over 4 devices"):
        eight(placed, eight.shard(DATA))
    moved = eight.replicate(eight.unreplicate(placed))  # what the message says to do
    new, _ = eight(moved, eight.shard(DATA))
    reference, _ = eight(eight.replicate(adam), eight.shard(DATA))
    models.assert_trees_close(eight.unreplicate(new), eight.unreplicate(reference), rtol=0)

"""Misuse of steps, batches and wrappers: each case answered with an error that names the
problem and the fix, or made to do the right thing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

BATCH = models.regression_batch(16)


def test_clip_by_global_norm_refuses_a_bound_that_would_reverse_the_update():
    for bad in (-1, 0, 0.0, "1"):
        with pytest.raises(ValueError, match="max_norm must be a number > 0"):
            jdp.clip_by_global_norm(bad)
    updates, _ = jdp.clip_by_global_norm(jnp.float32(1.0)).update(
        {"w": jnp.array([3.0, 4.0])}, optax.EmptyState()
    )
    np.testing.assert_allclose(updates["w"], [0.6, 0.8], rtol=1e-6)


def test_a_tuple_from_the_loss_without_has_aux_names_has_aux():
    def loss(params, batch):
        return models.mlp_loss(params, batch), {"extra": jnp.float32(1.0)}

    step = jdp.pmap(jdp.make_train_step(loss))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    with pytest.raises(TypeError, match=r"tuple of 2.*has_aux=True"):
        step(state, step.shard(BATCH))


def test_fit_runs_a_step_that_logs_no_loss(tmp_path):
    """A GAN-style step logging d_loss/g_loss, with and without the progress bar."""
    base = jdp.make_train_step(models.mlp_loss)

    @jdp.wraps(base)
    def gan_like(state, batch):
        state, metrics = base(state, batch)
        return state, {"d_loss": metrics["loss"], "g_loss": 2 * metrics["loss"]}

    step = jdp.pmap(gan_like)
    for progress in (False, True):
        state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
        data = jdp.BatchIterator(models.regression_batch(64), 16, seed=0)
        state, history = jdp.fit(step, state, data, num_steps=4, log_every=2, progress=progress)
        assert [row["step"] for row in history.train] == [2, 4]
        row = history.train[-1]
        assert row["g_loss"] == pytest.approx(2 * row["d_loss"], rel=1e-6)


def test_resuming_past_num_steps_is_an_error_not_a_later_state(tmp_path):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    fresh = lambda: step.replicate(  # noqa: E731
        jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    data = lambda: jdp.BatchIterator(models.regression_batch(64), 16, seed=0)  # noqa: E731
    ckpt = jdp.Checkpointer(tmp_path)
    jdp.fit(step, fresh(), data(), num_steps=6, checkpointer=ckpt, progress=False)
    with pytest.raises(ValueError, match=r"at step 6 \(restored from .*\), past num_steps=4"):
        jdp.fit(step, fresh(), data(), num_steps=4, checkpointer=ckpt, progress=False)
    state, _ = jdp.fit(step, fresh(), data(), num_steps=6, checkpointer=ckpt, progress=False)
    assert int(step.unreplicate(state).step) == 6  # equal is fine: nothing left to do
    ckpt.close()


def test_checkpointer_expands_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    ckpt = jdp.Checkpointer("~/runs/a")
    assert ckpt.directory == tmp_path / "home" / "runs" / "a"
    assert not (tmp_path / "~").exists()
    ckpt.close()


def test_saving_an_older_step_than_the_newest_checkpoint_is_an_error(tmp_path):
    state = jdp.replicate(jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1)))
    ckpt = jdp.Checkpointer(tmp_path)
    ckpt.save(10, state)
    with pytest.raises(ValueError, match="step 5 is older than checkpoint 10"):
        ckpt.save(5, state)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [10]
    ckpt.close()


def test_sharding_a_batch_twice_is_an_error_naming_the_leaf():
    once = jdp.shard(BATCH)
    with pytest.raises(ValueError, match=r"jdp.shard: batch leaf \['x'\].*sharded already"):
        jdp.shard(once)
    smap = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(ValueError, match=r"ShardMapStep.shard: batch leaf .*sharded already"):
        smap.shard(once)  # the pmap layout, handed to the other backend
    placed = smap.shard(BATCH)
    assert smap.shard(placed)["x"].sharding == placed["x"].sharding  # its own layout: a no-op
    pmap = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(ValueError, match="sharded already"):
        pmap.shard(placed)
    np.testing.assert_array_equal(jdp.unshard(np.asarray(once["x"])), BATCH["x"])


def test_jax_jit_around_a_step_composes(backend):
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    fresh = lambda: step.replicate(  # noqa: E731
        jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    batch = step.shard(BATCH)
    direct, _ = step(fresh(), batch)
    jitted, _ = jax.jit(step)(fresh(), batch)
    for a, b in zip(
        jax.tree.leaves(step.unreplicate(direct)),
        jax.tree.leaves(step.unreplicate(jitted)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("transform", ["vmap", "pmap"])
def test_mapping_a_mapped_step_says_so(transform):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    mapped = jax.vmap(step) if transform == "vmap" else jax.pmap(step, axis_name="batch")
    with pytest.raises(
        TypeError, match=r"called under jax.vmap or jax.pmap.*mapped over the devices already"
    ):
        mapped(state, step.shard(BATCH))


def test_nnx_dropout_without_a_key_is_an_error_not_one_mask_for_all():
    from flax import nnx

    import jdp.nnx

    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
    graphdef, params, model_state = jdp.nnx.split(model)

    def make(with_key, train=True):
        def loss_fn(params, batch, model_state, rng):
            m = jdp.nnx.merge(graphdef, params, model_state, rng=rng if with_key else None)
            m.train() if train else m.eval()
            return jnp.mean(m(batch) ** 2), jdp.nnx.state(m, model_state)

        return jdp.pmap(jdp.make_train_step(loss_fn, has_model_state=True, has_rng=True))

    def run(step):
        state = step.replicate(
            jdp.TrainState.create(
                params=params, tx=optax.sgd(0.1), model_state=model_state, rng=jax.random.key(0)
            )
        )
        return step(state, step.shard(jnp.ones((16, 3))))

    with pytest.raises(ValueError, match=r"drew random numbers .* no rng= to reseed"):
        run(make(with_key=False))
    _, metrics = run(make(with_key=True))
    assert len(set(np.asarray(metrics["loss"]).tolist())) > 1  # replicas drew their own masks
    run(make(with_key=False, train=False))  # no dropout drawn: nothing to refuse


def test_a_negative_weight_is_refused_where_it_can_be_seen():
    with pytest.raises(ValueError, match=r"weight must be >= 0 .* got -2.0"):
        jdp.WeightedLoss(total=jnp.float32(1.0), weight=jnp.float32(-2.0))
    assert float(jdp.WeightedLoss(jnp.float32(3.0), jnp.float32(2.0)).mean()) == 1.5

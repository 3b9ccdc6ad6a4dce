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
    for bad in (-1, 0, 0.0):
        with pytest.raises(ValueError, match="max_norm must be a number > 0"):
            jdp.clip_by_global_norm(bad)
    for kind in ("1", True):
        with pytest.raises(TypeError, match="max_norm must be a number > 0"):
            jdp.clip_by_global_norm(kind)
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


def counter_state():
    return jdp.TrainState.create(
        params=models.mlp_params(), tx=optax.sgd(0.1), model_state={"count": jnp.zeros(())}
    )


def run_once(loss, **kwargs):
    step = jdp.shard_map(jdp.make_train_step(loss, **kwargs))
    placed = step.replicate(counter_state() if kwargs.get("has_model_state") else plain_state())
    return step(placed, step.shard(BATCH))


def plain_state():
    return jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))


@pytest.mark.parametrize(
    ("loss", "kwargs", "match"),
    [
        (
            lambda p, b, state: (models.mlp_loss(p, b), state),
            {"has_model_state": True},
            r"^jdp.make_train_step\(has_model_state=True\) calls loss_fn\(params, batch, "
            r"model_state=\.\.\.\) by keyword, but loss_fn takes \(p, b, state\): name that "
            "parameter model_state",
        ),
        (
            lambda p, b, key: models.mlp_loss(p, b),
            {"has_rng": True},
            r"^jdp.make_train_step\(has_rng=True\) calls loss_fn\(params, batch, rng=\.\.\.\)",
        ),
        (
            lambda p, b, model_state: models.mlp_loss(p, b),
            {},
            r"^jdp.make_train_step: loss_fn\(p, b, model_state\) cannot be called as "
            r"loss_fn\(params, batch\) .*build the step with has_model_state=True",
        ),
        (
            lambda p: models.mlp_loss(p, BATCH),
            {},
            r"^jdp.make_train_step: loss_fn\(p\) cannot be called as loss_fn\(params, batch\)",
        ),
    ],
)
def test_a_loss_the_step_cannot_call_is_refused_when_the_step_is_built(loss, kwargs, match):
    with pytest.raises(TypeError, match=match):
        jdp.make_train_step(loss, **kwargs)


def test_losses_taking_keywords_any_way_are_accepted():
    def by_kwargs(params, batch, **extra):
        return models.mlp_loss(params, batch), extra["model_state"]

    def with_default(params, batch, model_state, scale=1.0):
        return scale * models.mlp_loss(params, batch), model_state

    for loss in (by_kwargs, with_default):
        _, metrics = run_once(loss, has_model_state=True)
        assert np.isfinite(np.asarray(metrics["loss"])).all()


def test_make_eval_step_checks_its_metric_function_too():
    with pytest.raises(
        TypeError, match=r"^jdp.make_eval_step\(has_model_state=True\) calls metric_fn"
    ):
        jdp.make_eval_step(lambda p, b, stats: {}, has_model_state=True)
    with pytest.raises(TypeError, match="^jdp.make_eval_step: metric_fn must be callable"):
        jdp.make_eval_step("loss")


@pytest.mark.parametrize(
    ("returned", "error", "match"),
    [
        (
            lambda ms: {**ms, "extra": jnp.zeros(())},
            ValueError,
            r"^jdp.make_train_step: loss_fn returned a model state of another structure than state.model_state",
        ),
        (
            lambda ms: {"count": ms["count"].astype(jnp.int32)},
            TypeError,
            r"^jdp.make_train_step: loss_fn returned model state leaf \['count'\] as int32\[\], but state.model_state "
            r"holds float32\[\]",
        ),
        (
            lambda ms: {"count": jnp.zeros(3)},
            TypeError,
            r"as float32\[3\], but state.model_state holds float32\[\]",
        ),
    ],
)
def test_a_model_state_of_another_structure_shape_or_dtype_is_refused(returned, error, match):
    def loss(params, batch, model_state):
        return models.mlp_loss(params, batch), returned(model_state)

    with pytest.raises(error, match=match):
        run_once(loss, has_model_state=True)


def test_an_nnx_loss_returning_the_module_is_told_what_to_return():
    nnx = pytest.importorskip("flax.nnx")
    import jdp.nnx

    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    graphdef, params, model_state = jdp.nnx.split(model)

    def loss(params, batch, model_state):
        module = jdp.nnx.merge(graphdef, params, model_state)
        return jnp.mean((module(batch["x"]) - batch["y"]) ** 2), module

    step = jdp.shard_map(jdp.make_train_step(loss, has_model_state=True))
    placed = step.replicate(
        jdp.TrainState.create(params=params, tx=optax.sgd(0.1), model_state=model_state)
    )
    with pytest.raises(
        ValueError, match=r"an NNX loss returns jdp.nnx.state\(model, model_state\), not the module"
    ):
        step(placed, step.shard(BATCH))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (
            lambda b: "hello",
            TypeError,
            r"^jdp.make_train_step: aux\['v'\] is a str \('hello'\); aux values are numeric",
        ),
        (lambda b: {"nested": 1.0}, TypeError, r"^jdp.make_train_step: aux\['v'\] is a dict"),
    ],
)
def test_aux_values_must_be_numeric(value, error, match):
    def loss(params, batch):
        return models.mlp_loss(params, batch), {"v": value(batch)}

    with pytest.raises(error, match=match):
        run_once(loss, has_aux=True)


@pytest.mark.parametrize("name", ["weights", "step"])
def test_an_evaluation_metric_named_as_evaluate_or_fit_name_their_entries_is_refused(name):
    evaluator = jdp.shard_map(
        jdp.make_eval_step(lambda p, b: {name: jnp.sum(b["x"], -1), "e": jnp.sum(b["x"], -1)})
    )
    with pytest.raises(
        ValueError, match=f"^jdp.make_eval_step: metric_fn returned a metric named '{name}'"
    ):
        jdp.evaluate(evaluator, evaluator.replicate(plain_state()), [BATCH])


def test_an_aux_metric_named_as_fit_names_its_row_entries_is_refused():
    def loss(params, batch):
        return models.mlp_loss(params, batch), {"step": jnp.float32(1.0)}

    with pytest.raises(ValueError, match=r"^jdp.make_train_step: aux keys \['step'\] are reserved"):
        run_once(loss, has_aux=True)


def test_a_list_of_examples_or_a_ragged_list_is_told_how_to_become_a_batch():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    records = [{"x": BATCH["x"][i], "y": BATCH["y"][i]} for i in range(16)]
    for shard in (step.shard, jdp.shard):
        with pytest.raises(
            TypeError,
            match=r"^jdp\.(shard|ShardMapStep\.shard): the batch is a list of 16 dicts, one per example\?",
        ):
            shard(records)
    scalars = [{"x": 1.0, "y": 2.0}] * 16
    with pytest.raises(TypeError, match="list of 16 dicts"):
        step.shard(scalars)
    ragged = {"x": [[1.0, 2.0]] * 8 + [[1.0]] * 8}
    with pytest.raises(
        TypeError, match="It sits in a Python list: convert the list with np.asarray"
    ):
        step.shard(ragged)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *records)  # the fix the message gives
    np.testing.assert_array_equal(np.asarray(step.shard(stacked)["x"]), BATCH["x"])

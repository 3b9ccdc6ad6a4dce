"""Flax NNX under jdp: same numbers as single-device NNX training, state in its place."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
import jdp.nnx
from tests import models

Net = models.NnxNet  # Linear -> BatchNorm -> ReLU -> Dropout -> Linear


def make_loss(graphdef, train: bool):
    def loss_fn(params, batch, model_state, rng):
        model = jdp.nnx.merge(graphdef, params, model_state, rng=rng if train else None)
        model.train() if train else model.eval()
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (jdp.nnx.state(model, model_state), {"out_sum": jnp.sum(logits)})

    return loss_fn


@pytest.mark.parametrize("n", [2, 8])
def test_nnx_equals_single_device_nnx_training(n, backend):
    graphdef, params, model_state = jdp.nnx.split(Net(nnx.Rngs(0)))
    data = [models.classification_batch(32, seed=70 + i) for i in range(4)]
    tx = optax.adam(1e-2)

    # The reference, written with plain flax.nnx: eval mode (running averages,
    # no dropout), so examples are independent and the split cannot matter.
    reference_model = Net(nnx.Rngs(0))
    reference_model.eval()
    ref_graphdef, ref_params, ref_rest = nnx.split(reference_model, nnx.Param, ...)

    def reference_loss(p, batch):
        model = nnx.merge(ref_graphdef, p, ref_rest)
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    expected, _ = models.train_single_device(reference_loss, ref_params, tx, data)

    step = models.backend(
        backend,
        jdp.make_train_step(
            make_loss(graphdef, train=False), has_aux=True, has_model_state=True, has_rng=True
        ),
        n,
    )
    state = step.replicate(
        jdp.TrainState.create(params=params, tx=tx, model_state=model_state, rng=jax.random.key(1))
    )
    for batch in data:
        state, _ = step(state, step.shard(batch))
    jdp.assert_replicas_in_sync(state)
    models.assert_trees_close(step.unreplicate(state).params, expected, rtol=1e-5, atol=1e-7)


def test_batch_statistics_average_and_rng_state_stays_in_sync(backend):
    graphdef, params, model_state = jdp.nnx.split(Net(nnx.Rngs(0)))
    rest, rngs = model_state
    assert "norm" in rest and "hidden" not in rest  # batch stats are model state
    assert jax.tree.leaves(rngs)  # RNG state kept apart, not in params
    assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(params))
    step = models.backend(
        backend,
        jdp.make_train_step(
            make_loss(graphdef, train=True), has_aux=True, has_model_state=True, has_rng=True
        ),
        8,
    )
    state = jdp.TrainState.create(
        params=params, tx=optax.sgd(0.0), model_state=model_state, rng=jax.random.key(1)
    )
    # Every replica gets the same 2 rows: outputs can differ only by dropout.
    rows = np.stack([np.arange(6, dtype=np.float32), np.ones(6, np.float32)])
    batch = {"x": np.tile(rows, (8, 1)), "label": np.zeros(16, np.int32)}
    new, metrics = step(step.replicate(state), step.shard(batch))
    jdp.assert_replicas_in_sync(new)  # batch stats averaged, RNG state untouched
    after = step.unreplicate(new).model_state
    assert not np.allclose(after[0]["norm"]["mean"][...], rest["norm"]["mean"][...])
    for a, b in zip(jax.tree.leaves(after[1]), jax.tree.leaves(rngs), strict=True):
        np.testing.assert_array_equal(_data(a), _data(b))
    assert len(np.unique(np.asarray(metrics["out_sum"]))) == 8  # a mask per replica


def _data(x):
    return jax.random.key_data(x) if jdp._tree.is_prng_key(x) else x


def test_nnx_state_checkpoint_round_trip(tmp_path):
    graphdef, params, model_state = jdp.nnx.split(Net(nnx.Rngs(0)))
    state = jdp.replicate(
        jdp.TrainState.create(
            params=params, tx=optax.adam(1e-2), model_state=model_state, rng=jax.random.key(2)
        )
    )
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state)
        restored, _ = ckpt.restore(state)
    a, b = jdp.unreplicate(state), jdp.unreplicate(restored)
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.tree.leaves(jax.tree.map(_data, a)),
        jax.tree.leaves(jax.tree.map(_data, b)),
    )
    model = jdp.nnx.merge(graphdef, b.params, b.model_state)
    model.eval()
    assert model(jnp.ones((2, 6))).shape == (2, 4)


def test_split_refuses_a_non_module():
    with pytest.raises(TypeError, match="expects an nnx.Module, got dict"):
        jdp.nnx.split({"w": jnp.ones(2)})

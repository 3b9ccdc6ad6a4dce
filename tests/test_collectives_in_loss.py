"""Collectives inside the loss: exact in the ordinary step, refused where they cannot be.

A contrastive loss that all-gathers embeddings for global negatives (CLIP,
SimCLR) and sync batch norm (Flax BatchNorm with axis_name) compute the
global-batch objective in the ordinary step: the references are
single-device training on the global batch. Inside a loop over
micro-batches (exact mode, accumulate_steps) the collective would see one
micro-batch per device, so those modes refuse the loss when it is traced.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jdp
from tests import models

TEMPERATURE = 0.5


def embed(params, x):
    z = jnp.tanh(x @ params["w"])
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def contrastive_loss(params, batch):
    """Each replica's anchors against every replica's positives (global negatives)."""
    anchors, positives = embed(params, batch["a"]), embed(params, batch["b"])
    everyone = lax.all_gather(positives, "batch", tiled=True)
    labels = lax.axis_index("batch") * anchors.shape[0] + jnp.arange(anchors.shape[0])
    logits = anchors @ everyone.T / TEMPERATURE
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def contrastive_reference(params, batch):
    anchors, positives = embed(params, batch["a"]), embed(params, batch["b"])
    logits = anchors @ positives.T / TEMPERATURE
    labels = jnp.arange(anchors.shape[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def contrastive_data(count=4, size=32):
    r = np.random.RandomState(0)
    data = []
    for _ in range(count):
        a = r.randn(size, 6).astype(np.float32)
        data.append({"a": a, "b": a + 0.3 * r.randn(size, 6).astype(np.float32)})
    return data


CONTRASTIVE_PARAMS = {"w": jnp.asarray(np.random.RandomState(1).randn(6, 8) / 2, jnp.float32)}


class SyncBN(nn.Module):
    axis_name: str | None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(4)(nn.relu(x))


def sync_bn_loss(axis_name):
    def loss_fn(params, batch, model_state):
        logits, updates = SyncBN(axis_name).apply(
            {"params": params, "batch_stats": model_state}, batch["x"], mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, updates["batch_stats"]

    return loss_fn


def test_contrastive_loss_with_global_negatives_equals_single_device(backend):
    data = contrastive_data()
    tx = optax.sgd(0.5)
    expected, _ = models.train_single_device(contrastive_reference, CONTRASTIVE_PARAMS, tx, data)
    state = jdp.TrainState.create(params=CONTRASTIVE_PARAMS, tx=tx)
    final, _ = models.train_parallel(jdp.make_train_step(contrastive_loss), state, data, backend, 8)
    assert not np.allclose(final.params["w"], CONTRASTIVE_PARAMS["w"], rtol=1e-3)
    models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-7)


def test_sync_batch_norm_equals_single_device(backend):
    variables = SyncBN(None).init(jax.random.key(0), jnp.zeros((1, 6)))
    data = [models.classification_batch(32, seed=40 + i) for i in range(4)]
    tx = optax.sgd(0.1)
    expected, _ = models.train_single_device(
        sync_bn_loss(None), variables["params"], tx, data, variables["batch_stats"]
    )
    state = jdp.TrainState.create(
        params=variables["params"], tx=tx, model_state=variables["batch_stats"]
    )
    step = jdp.make_train_step(sync_bn_loss("batch"), has_model_state=True)
    final, _ = models.train_parallel(step, state, data, backend, 8)
    models.assert_trees_close(final.params, expected, rtol=1e-5, atol=1e-7)
    # Statistics too: the single-device reference's, from the same global batches.
    reference_stats = variables["batch_stats"]
    reference_params = variables["params"]
    for batch in data:
        grads, reference_stats = jax.grad(sync_bn_loss(None), has_aux=True)(
            reference_params, batch, reference_stats
        )
        reference_params = jax.tree.map(lambda p, g: p - 0.1 * g, reference_params, grads)
    models.assert_trees_close(final.model_state, reference_stats, rtol=1e-5, atol=1e-7)


MICRO_BATCH_MODES = {
    "exact": lambda: jdp.strategies.exact(8),
    "accumulate": lambda: jdp.strategies.data_parallel(accumulate_steps=2),
    "zero1 accumulate": lambda: jdp.strategies.zero1(accumulate_steps=2),
}


@pytest.mark.parametrize("mode", sorted(MICRO_BATCH_MODES))
def test_micro_batch_modes_refuse_a_contrastive_loss_naming_the_collective(mode, backend):
    state = jdp.TrainState.create(params=CONTRASTIVE_PARAMS, tx=optax.sgd(0.5))
    step = models.backend(
        backend, jdp.make_train_step(contrastive_loss, strategy=MICRO_BATCH_MODES[mode]()), 4
    )
    with pytest.raises(ValueError) as raised:
        step(step.replicate(state), step.shard(contrastive_data(1)[0]))
    first_line = str(raised.value).splitlines()[0]
    assert re.search(r"(?i)the loss calls lax\.all_gather over the data axis", first_line)
    assert re.search(r"data_parallel\(\) \(no accumulate_steps\)|accumulate_steps=1", first_line)


@pytest.mark.parametrize("mode", sorted(MICRO_BATCH_MODES))
def test_micro_batch_modes_refuse_sync_batch_norm_naming_the_collective(mode):
    variables = SyncBN(None).init(jax.random.key(0), jnp.zeros((1, 6)))
    state = jdp.TrainState.create(
        params=variables["params"], tx=optax.sgd(0.1), model_state=variables["batch_stats"]
    )
    step = jdp.pmap(
        jdp.make_train_step(
            sync_bn_loss("batch"), has_model_state=True, strategy=MICRO_BATCH_MODES[mode]()
        ),
        devices=models.devices(2),
    )
    with pytest.raises(ValueError, match=r"calls lax\.psum over the data axis"):
        step(step.replicate(state), step.shard(models.classification_batch(32)))


def test_a_collective_over_another_axis_is_not_refused():
    def loss_fn(params, batch):
        per_example = jax.vmap(lambda x: lax.psum(x @ params["w"], "inner"), axis_name="inner")
        return jnp.mean(per_example(batch["a"]) ** 2)

    state = jdp.TrainState.create(params=CONTRASTIVE_PARAMS, tx=optax.sgd(0.1))
    step = jdp.pmap(jdp.make_train_step(loss_fn, strategy=jdp.strategies.exact(8)))
    batch = contrastive_data(1)[0]
    _, metrics = step(step.replicate(state), step.shard(batch))
    # The "inner" sum runs over each virtual replica's 4 examples, whatever the device count.
    sums = (batch["a"] @ np.asarray(CONTRASTIVE_PARAMS["w"])).reshape(8, 4, -1).sum(axis=1)
    np.testing.assert_allclose(float(metrics["loss"][0]), np.mean(sums**2), rtol=1e-5)

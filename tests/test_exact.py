"""Exact mode: bitwise the same result on any number of devices and processes.

Every model family, on 1, 2, 4, 8 devices: tests/test_zoo.py; across processes:
tests/test_zoo_processes.py.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.testing import check_exact
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
G = 8
DATA = models.regression_batch(512, seed=3)


def dropout_loss(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = jnp.where(jax.random.bernoulli(rng, 0.8, h.shape), h / 0.8, 0.0)
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def exact_step(**kwargs):
    return jdp.make_train_step(
        dropout_loss, has_rng=True, strategy=jdp.strategies.exact(G), **kwargs
    )


def initial_state(**kwargs):
    return jdp.TrainState.create(
        params=models.mlp_params(), tx=optax.adam(1e-2), rng=jax.random.key(0), **kwargs
    )


def batches(count=20, size=64):
    it = jdp.BatchIterator(DATA, size, seed=0, num_devices=1)
    return [next(it) for _ in range(count)]


def test_weighted_loss_and_loss_scale_skip_are_bitwise_equal(backend):
    def token_loss(params, batch):
        err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jdp.weighted_mean(err, batch["real"])

    data = []
    for i in range(10):
        padded, real = jdp.pad_batch(models.regression_batch(40, seed=300 + i), 64)
        data.append({**padded, "real": real})
    data[3]["x"][2, 1] = np.inf  # an overflow: the step is skipped, everywhere alike
    state = jdp.TrainState.create(
        params=models.mlp_params(),
        tx=optax.adam(1e-2),
        loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**10), period=3),
    )
    results = check_exact(
        lambda: jdp.make_train_step(token_loss, strategy=jdp.strategies.exact(G)),
        state,
        data,
        backend=getattr(jdp, backend),
    )
    assert int(results[1][0].skipped_steps) == 1
    assert results[4][1]["virtual_replica_loss"].shape == (G,)


def test_exact_equals_the_ordinary_step_within_float_rounding():
    data = batches(10)
    ordinary = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    exact = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(G)))
    finals = []
    for step in (ordinary, exact):
        state = step.replicate(initial_state())
        for batch in data:
            state, _ = step(state, step.shard(batch))
        finals.append(step.unreplicate(state).params)
    models.assert_trees_close(finals[1], finals[0], rtol=1e-6, atol=1e-7)


def test_checkpoint_at_8_devices_resumes_at_2_under_the_other_backend_bitwise(backend, tmp_path):
    # Written under one backend on 8 devices, resumed under the other on 2.
    other = {"pmap": "shard_map", "shard_map": "pmap"}[backend]
    data = batches(12)
    make = lambda: exact_step(metrics=[jdp.metrics.grad_norm()])  # noqa: E731
    run = lambda state, data, n, name: check_exact(  # noqa: E731
        make, state, data, device_counts=(n,), backend=getattr(jdp, name)
    )[n]
    straight = run(initial_state(), data, 8, backend)
    first = run(initial_state(), data[:6], 8, backend)
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(6, first[0])
        restored, _ = ckpt.restore(initial_state())
    resumed = run(jdp.unreplicate(restored), data[6:], 2, other)
    flat = jax.tree_util.tree_flatten_with_path(straight)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=jax.tree_util.keystr(path))


def _bits(x):
    return np.asarray(jax.random.key_data(x) if jdp._tree.is_prng_key(x) else x)


def test_exact_mode_errors():
    with pytest.raises(ValueError, match="virtual_replicas must be a power of two .* got 6"):
        jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(6))
    with pytest.raises(
        TypeError, match="exact.. got an unexpected keyword argument 'accumulate_steps'"
    ):
        jdp.strategies.exact(8, accumulate_steps=2)  # exact mode has its own micro-batches
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(4)))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    with pytest.raises(ValueError, match="virtual_replicas=4 is not divisible by the 8 devices"):
        step(state, step.shard(models.regression_batch(32)))
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(16)))
    with pytest.raises(ValueError, match="global batch of 24 examples does not split into"):
        step(state, step.shard(models.regression_batch(24)))

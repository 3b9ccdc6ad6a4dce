"""The same step under pmap and shard_map gives the same parameters (rtol 1e-6)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models


def _masked_loss(params, batch):
    per_example = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
    return jdp.weighted_mean(per_example, batch["mask"])


def _padded(i):
    batch, mask = jdp.pad_batch(models.regression_batch(19, seed=40 + i), 32)
    return {**batch, "mask": mask}


def _overflowing(i):
    batch = models.regression_batch(32, seed=50 + i)
    if i == 2:
        batch["x"][9, 1] = np.inf
    return batch


CASES = {
    "mean": (
        lambda: jdp.make_train_step(models.mlp_loss),
        lambda i: models.regression_batch(32, seed=i),
        {},
    ),
    "sum": (
        lambda: jdp.make_train_step(
            models.mlp_loss, strategy=jdp.strategies.data_parallel(reduce="sum")
        ),
        lambda i: models.regression_batch(32, seed=i),
        {},
    ),
    "accumulate": (
        lambda: jdp.make_train_step(
            models.mlp_loss, strategy=jdp.strategies.data_parallel(accumulate_steps=4)
        ),
        lambda i: models.regression_batch(32, seed=i),
        {},
    ),
    "mask": (lambda: jdp.make_train_step(_masked_loss), _padded, {}),
    "dynamic_loss_scale": (
        lambda: jdp.make_train_step(
            models.mlp_loss, precision=jdp.Policy(jnp.float16, cast_batch=("x", "y"))
        ),
        _overflowing,
        {"loss_scale": jdp.DynamicLossScale(jnp.float32(2.0**10), period=2)},
    ),
}


def _train(backend, case):
    make_step, batch_at, extra = CASES[case]
    step = models.backend(backend, make_step(), 8)
    state = step.replicate(
        jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2), **extra)
    )
    for i in range(5):
        state, metrics = step(state, step.shard(batch_at(i)))
    return jdp.unreplicate(state), metrics


@pytest.mark.parametrize("case", sorted(CASES))
def test_backends_agree(case):
    p, pm = _train("pmap", case)
    s, sm = _train("shard_map", case)
    models.assert_trees_close(s.params, p.params, rtol=1e-6, atol=1e-8)
    models.assert_trees_close(s.opt_state, p.opt_state, rtol=1e-6, atol=1e-8)
    assert (
        int(s.skipped_steps) == int(p.skipped_steps) == (1 if case == "dynamic_loss_scale" else 0)
    )
    np.testing.assert_allclose(sm["loss"], pm["loss"], rtol=1e-6)
    assert sm["loss"].shape == pm["loss"].shape == (8,)


def test_backends_agree_on_model_state_and_rng():
    variables = models.classifier_variables()
    out = {}
    for backend in ("pmap", "shard_map"):
        step = models.backend(
            backend,
            jdp.make_train_step(models.classifier_train_loss, has_model_state=True, has_rng=True),
            8,
        )
        state = step.replicate(
            jdp.TrainState.create(
                params=variables["params"],
                tx=optax.adam(1e-2),
                model_state=variables["batch_stats"],
                rng=jax.random.key(5),
            )
        )
        for i in range(3):
            state, _ = step(state, step.shard(models.classification_batch(32, seed=i)))
        out[backend] = jdp.unreplicate(state)
    models.assert_trees_close(out["shard_map"].params, out["pmap"].params, rtol=1e-6, atol=1e-8)
    models.assert_trees_close(
        out["shard_map"].model_state, out["pmap"].model_state, rtol=1e-6, atol=1e-8
    )


def test_after_the_first_call_a_one_device_step_keeps_every_check_it_needs(backend):
    """The fast path (one device, one process): consumed state, other layout, bad leaf."""
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 1)
    fresh = lambda: jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))  # noqa: E731
    batches = [step.shard(models.regression_batch(8, seed=i)) for i in range(3)]
    state = step.replicate(fresh())
    step(state, batches[0])  # the first call checks everything, then goes lean
    assert step._lean
    with pytest.raises(
        RuntimeError, match=r"^jdp: this state was consumed by an earlier step call"
    ):
        step(state, batches[1])
    # A state in the other backend's layout is still re-placed, bitwise as the own one.
    other = "pmap" if backend == "shard_map" else "shard_map"
    foreign = models.backend(other, jdp.make_train_step(models.mlp_loss), 1).replicate(fresh())
    own, _ = step(step.replicate(fresh()), batches[0])
    moved, _ = step(foreign, batches[0])
    for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and a leaf JAX cannot take is named
    bad = {**models.regression_batch(8, seed=0), "name": "not an array"}
    with pytest.raises(TypeError, match=r"^jdp\.\w+ step: the batch must be a pytree of arrays"):
        step(moved, bad)


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_with_step_runs_another_step_on_the_same_devices_and_donation(backend):
    """``with_step`` equals wrapping the other step the same way: bitwise, same devices."""
    wrap = getattr(jdp, backend)
    devices = jax.devices()[2:6]
    first = wrap(jdp.make_train_step(models.mlp_loss), devices=devices, donate_state=False)
    other = jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1())
    rebuilt, direct = first.with_step(other), wrap(other, devices=devices, donate_state=False)
    assert type(rebuilt) is type(direct) and rebuilt.step is other
    assert not rebuilt.donates_state
    init = jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2))
    states = [s.replicate(init) for s in (rebuilt, direct)]
    for i in range(3):
        batch = models.regression_batch(32, seed=i)
        states = [s(x, s.shard(batch))[0] for s, x in zip((rebuilt, direct), states, strict=True)]
    assert {d for x in jax.tree.leaves(states[0]) for d in x.devices()} == set(devices)
    for a, b in zip(*(jax.tree.leaves(jdp.unreplicate(s)) for s in states), strict=True):
        assert np.array_equal(a, b)

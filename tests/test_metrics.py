"""Metrics as values: each carries how a step computes it and how replicas combine in fit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

DATA = models.regression_batch(64, seed=21)


def state():
    return jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2))


def fit(step, num_steps=2):
    _, history = jdp.fit(
        step,
        step.replicate(state()),
        jdp.BatchIterator(DATA, 32, shuffle=False),
        num_steps=num_steps,
        log_every=1,
        progress=False,
    )
    return history.train


def test_a_metric_value_is_computed_and_logged_by_its_rule(backend):
    """A new metric is one value: its compute and its rule, nothing else changes."""
    param_norm = jdp.metrics.Metric(
        "param_norm", lambda view: optax.tree.norm(view.after.params), jdp.metrics.same
    )
    replica = jdp.metrics.Metric(
        "replica",
        lambda view: jax.lax.axis_index(view.axis_name).astype(jnp.float32),
        jdp.metrics.total,
    )
    step = models.backend(
        backend, jdp.make_train_step(models.mlp_loss, metrics=[param_norm, replica]), 8
    )
    rows = fit(step)
    first = {k: v[:32] for k, v in DATA.items()}  # fit's first batch (no shuffling)
    after, _ = step(step.replicate(state()), step.shard(first))
    expected = float(optax.tree.norm(step.unreplicate(after).params))
    np.testing.assert_allclose(rows[0]["param_norm"], expected, rtol=1e-6)
    assert rows[0]["replica"] == float(sum(range(8)))  # total: the sum over replicas
    assert rows[0]["replica_per_replica"] == [float(i) for i in range(8)]


def test_grad_norm_and_learning_rate_as_values_equal_the_flags():
    schedule = optax.linear_schedule(0.1, 0.01, 10)

    def make(**kwargs):
        step = jdp.shard_map(jdp.make_train_step(models.mlp_loss, **kwargs))
        s = jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(schedule))
        _, m = step(step.replicate(s), step.shard(DATA))
        return jax.device_get(m)

    flags = make(log_grad_norm=True, log_learning_rate=schedule)
    values = make(metrics=[jdp.metrics.grad_norm(), jdp.metrics.learning_rate(schedule)])
    for name in ("grad_norm", "learning_rate"):
        np.testing.assert_array_equal(flags[name], values[name])
    np.testing.assert_allclose(values["learning_rate"][0], 0.1, rtol=1e-6)


def test_a_vector_aux_metric_stays_a_vector():
    def loss(params, batch):
        err = (models.mlp_forward(params, batch) - batch["y"]) ** 2
        return jnp.mean(err), {"per_output": jnp.mean(err, axis=0)}

    step = jdp.shard_map(jdp.make_train_step(loss, has_aux=True))
    rows = fit(step, num_steps=1)
    params = models.mlp_params()
    first = {k: v[:32] for k, v in DATA.items()}
    expected = np.mean((models.mlp_forward(params, first) - first["y"]) ** 2, axis=0)
    np.testing.assert_allclose(rows[0]["per_output"], expected, rtol=1e-5)
    # Accumulated over micro-batches it is the same mean (it used to fail to trace).
    step = jdp.shard_map(
        jdp.make_train_step(
            loss, has_aux=True, strategy=jdp.strategies.data_parallel(accumulate_steps=2)
        )
    )
    np.testing.assert_allclose(fit(step, num_steps=1)[0]["per_output"], expected, rtol=1e-5)


def test_exact_mode_logs_the_global_loss_as_it_is():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(8)))
    rows = fit(step, num_steps=1)
    assert rows[0]["loss"] == rows[0]["loss_per_replica"][0]
    rules = dict(step.step.metric_rules)
    assert rules["loss"] is jdp.metrics.same and rules["skipped_steps"] is jdp.metrics.exact_int


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"metrics": jdp.metrics.grad_norm()}, TypeError, "metrics must be a list"),
        ({"metrics": ["grad_norm"]}, TypeError, "not a jdp.metrics.Metric"),
        (
            {"metrics": [jdp.metrics.grad_norm()], "log_grad_norm": True},
            ValueError,
            r"\['grad_norm'\] are given twice",
        ),
        (
            {"metrics": [jdp.metrics.Metric("loss", lambda v: v.before.step)]},
            ValueError,
            r"\['loss'\] are given twice or are the step's own",
        ),
        ({"log_learning_rate": "yes"}, TypeError, "takes True or an optax schedule"),
        ({"log_grad_norm": 1}, TypeError, "log_grad_norm must be a bool"),
    ],
)
def test_metric_arguments_are_checked_when_the_step_is_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        jdp.make_train_step(models.mlp_loss, **kwargs)


def test_an_aux_metric_may_not_shadow_a_requested_metric():
    def loss(params, batch):
        return models.mlp_loss(params, batch), {"grad_norm": jnp.zeros(())}

    step = jdp.shard_map(jdp.make_train_step(loss, has_aux=True, log_grad_norm=True))
    with pytest.raises(ValueError, match=r"aux keys \['grad_norm'\] are reserved"):
        step(step.replicate(state()), step.shard(DATA))

"""Layouts as values: every strategy's state through every backend and every state function.

The matrix: strategies x backends x (step, sync_replicas, unreplicate,
assert_replicas_in_sync, a checkpoint round trip, evaluate), each compared
with an independent reference (the same training with the step's own
placement helpers, or the logical state before the call). And switching
backends is one line: jdp.replicate / jdp.shard (the pmap layout) fed to a
shard_map step, and a shard_map step's placement fed to a pmap step, train
bitwise like each backend's own helpers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp import _layout
from tests import models

STRATEGIES = {
    "data_parallel": jdp.strategies.data_parallel,
    "zero1": jdp.strategies.zero1,
    "exact": lambda: jdp.strategies.exact(8),
}
DATA = [models.regression_batch(32, seed=700 + i) for i in range(3)]


def initial_state():
    return jdp.TrainState.create(params=models.mlp_params(hidden=13), tx=optax.adam(1e-2))


def trained(strategy, backend):
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss, strategy=strategy()), 8)
    state = step.replicate(initial_state())
    for batch in DATA:
        state, _ = step(state, step.shard(batch))
    return step, state


def assert_bitwise(a, b):
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(
            np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_state_function_on_every_strategy(name, backend, tmp_path):
    step, state = trained(STRATEGIES[name], backend)
    assert _layout.layout_of(state) is step.layout
    logical = step.unreplicate(state)
    assert isinstance(logical.opt_state, tuple)  # zero1's split state comes back whole
    jdp.assert_replicas_in_sync(state)
    # sync_replicas keeps the layout and the values (it crashed on zero1 states).
    synced = jdp.sync_replicas(state)
    assert jax.tree.structure(synced) == jax.tree.structure(state)
    assert _layout.layout_of(synced) is step.layout
    jdp.assert_replicas_in_sync(synced)
    assert_bitwise(jdp.unreplicate(synced), logical)
    # A synced state trains on exactly as the original.
    after, _ = step(synced, step.shard(DATA[0]))
    expected, _ = step(state, step.shard(DATA[0]))
    assert_bitwise(step.unreplicate(after), step.unreplicate(expected))
    # A checkpoint restores into the same layout, bitwise.
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, after)
        restored, _ = ckpt.restore(after)
    assert _layout.layout_of(restored) is step.layout
    assert_bitwise(step.unreplicate(restored), step.unreplicate(after))
    # Evaluation reads the whole params under every strategy.
    evaluator = models.backend(backend, jdp.make_eval_step(_metrics), 8)
    result = jdp.evaluate(evaluator, restored, [DATA[1]])
    params = step.unreplicate(restored).params
    reference = float(
        np.mean(np.sum((models.mlp_forward(params, DATA[1]) - DATA[1]["y"]) ** 2, -1))
    )
    np.testing.assert_allclose(result["squared_error"], reference, rtol=1e-6)


def _metrics(params, batch):
    return {"squared_error": jnp.sum((models.mlp_forward(params, batch) - batch["y"]) ** 2, -1)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_switching_backends_is_one_line(name):
    """The pmap layout's helpers under a shard_map step, and the reverse, train bitwise alike."""
    _, reference = trained(STRATEGIES[name], "shard_map")
    expected = jdp.unreplicate(reference)
    # jdp.replicate and jdp.shard (the pmap layout) fed to a shard_map step.
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss, strategy=STRATEGIES[name]()))
    state = jdp.replicate(initial_state())
    for batch in DATA:
        state, metrics = step(state, jdp.shard(batch))
    assert _layout.layout_of(state) is _layout.MESH_REPLICATED
    assert metrics["loss"].shape == (8,)
    assert_bitwise(step.unreplicate(state), expected)
    # A shard_map step's placement fed to a pmap step.
    pmapped = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=STRATEGIES[name]()))
    state = step.replicate(initial_state())
    for batch in DATA:
        state, _ = pmapped(state, step.shard(batch))
    assert _layout.layout_of(state) is _layout.LEADING_AXIS
    _, own = trained(STRATEGIES[name], "pmap")
    assert_bitwise(pmapped.unreplicate(state), jdp.unreplicate(own))


def test_a_pmap_layout_batch_of_one_example_per_device_is_not_a_global_batch():
    """jdp.shard's (8, 1, ...) batch and a global batch of 8 examples differ by their sharding."""
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    batch = models.regression_batch(8, seed=3)
    own, _ = step(step.replicate(initial_state()), step.shard(batch))
    other, _ = step(step.replicate(initial_state()), jdp.shard(batch))
    assert_bitwise(step.unreplicate(other), step.unreplicate(own))


def test_layout_of_names_a_mixed_tree():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    mixed = {"a": jdp.replicate(jnp.ones(3)), "b": step.replicate(jnp.ones(3))}
    with pytest.raises(ValueError, match=r"mixes layouts: leaf \['a'\] .* leaf \['b'\]"):
        _layout.layout_of(mixed)
    assert _layout.layout_of({"host": np.ones(3)}) is None


def test_shard_map_takes_devices_as_pmap_does():
    devices = jax.devices()[:4]
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss), devices=devices)
    assert list(step.mesh.devices.flat) == devices and step.mesh.axis_names == ("batch",)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("batch",))
    with pytest.raises(ValueError, match="pass mesh= or devices=, not both"):
        jdp.shard_map(jdp.make_train_step(models.mlp_loss), mesh=mesh, devices=devices)


def test_evaluate_on_one_device_equals_eight(backend):
    """On a one-device mesh JAX gives per-replica outputs the replicated spec; evaluate reads rows."""
    results = []
    for n in (1, 8):
        step = models.backend(backend, jdp.make_eval_step(_metrics), n)
        placed = step.replicate(initial_state())
        results.append(jdp.evaluate(step, placed, [DATA[0], DATA[1]]))
    np.testing.assert_allclose(results[0]["squared_error"], results[1]["squared_error"], rtol=1e-6)
    assert results[0]["weights"] == results[1]["weights"] == {"squared_error": 64.0}

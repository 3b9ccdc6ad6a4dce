"""Exact mode with the optimizer state split: zero1's memory, exact mode's bits.

``strategies.exact(G, shard_optimizer_state=True)`` against ``exact(G)`` on one
device, with ``np.array_equal`` on every leaf.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.testing import check_exact
from tests import models, test_zero1, zoo

G = 8
PARAMS = test_zero1.PARAMS  # leaves of 78, 13 and 39 elements: padded slices at n = 2, 4, 8
DATA = test_zero1.DATA[:10]
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
OPTIMIZERS = {
    **test_zero1.OPTIMIZERS,
    "adamw_schedule_mask_clip": lambda: optax.chain(
        jdp.clip_by_global_norm(0.5),
        optax.adamw(SCHEDULE, weight_decay=0.1, mask=test_zero1.decay_kernels),
    ),
}


def strategy(shard):
    return jdp.strategies.exact(G, shard_optimizer_state=shard)


def make_step(shard, backend, n):
    return models.backend(
        backend, jdp.make_train_step(models.mlp_loss, strategy=strategy(shard)), n
    )


def train(tx, shard, backend, n, data=DATA):
    step = make_step(shard, backend, n)
    state, metrics = step.replicate(jdp.TrainState.create(params=PARAMS, tx=tx)), None
    for batch in data:
        state, metrics = step(state, step.shard(batch))
    return step, state, metrics


def assert_bitwise(actual, expected):
    for (path, a), e in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True
    ):
        assert np.array_equal(np.asarray(a), np.asarray(e)), jax.tree_util.keystr(path)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bitwise_equal_to_unsharded_exact_on_1_2_4_8_devices(name, backend):
    step, state, metrics = train(OPTIMIZERS[name](), False, "pmap", 1)
    expected, expected_loss = step.unreplicate(state), np.asarray(metrics["loss"])[0]
    for n in (1, 2, 4, 8):
        step, state, metrics = train(OPTIMIZERS[name](), True, backend, n)
        if n > 1:  # on one device nothing is split
            assert isinstance(state.opt_state, jdp.ShardedOptState)
            assert state.opt_state.num_shards == n
        assert_bitwise(step.unreplicate(state), expected)
        assert np.array_equal(np.asarray(metrics["loss"]), np.full(n, expected_loss))


def test_the_optimizer_state_is_one_nth_per_device(backend):
    _, state, _ = train(optax.adam(1e-2), True, backend, 8, data=DATA[:1])
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.float32 and x.size > 1]
    held = sum(min(x.addressable_shards, key=lambda s: s.device.id).data.nbytes for x in moments)
    whole = 2 * sum(x.nbytes for x in jax.tree.leaves(PARAMS))  # Adam's mu and nu
    # Each leaf's slice is ceil(size / 8) elements: 10 + 2 + 5 of 78 + 13 + 39.
    assert held == 2 * 4 * (10 + 2 + 5)
    assert held < whole / 8 * 1.35


def test_checkpoints_cross_between_the_split_and_the_whole_state_bitwise(tmp_path, backend):
    tx = test_zero1.OPTIMIZERS["clipped_adam"]
    step, state, _ = train(tx(), False, "pmap", 1)
    expected = step.unreplicate(state)
    for (shard, n), (then_shard, then_n) in [((True, 8), (False, 2)), ((False, 4), (True, 2))]:
        _, state, _ = train(tx(), shard, backend, n, data=DATA[:5])
        with jdp.Checkpointer(tmp_path / f"{shard}-{n}") as ckpt:
            ckpt.save(5, state)
            ckpt.wait_until_finished()
            fresh = jdp.TrainState.create(params=PARAMS, tx=tx())
            step = make_step(then_shard, backend, then_n)
            state, _ = ckpt.restore(step.replicate(fresh))
        for batch in DATA[5:]:
            state, _ = step(state, step.shard(batch))
        assert_bitwise(step.unreplicate(state), expected)


def test_two_processes_of_two_devices_equal_one_of_four_bitwise(backend, tmp_path):
    out = {}
    for processes, devices in [(2, 2), (1, 4)]:
        path = tmp_path / f"{processes}x{devices}.npz"
        directory = tmp_path / f"c{processes}"
        models.launch(
            "multiprocess_zero.py", processes, devices, path, backend, directory, "exact_split"
        )
        out[processes] = np.load(path)
    assert set(out[1].files) == set(out[2].files)
    for name in out[1].files:
        assert np.array_equal(out[2][name], out[1][name]), name


def test_misuse_gets_clear_errors():
    with pytest.raises(TypeError, match=r"^jdp.strategies.exact: shard_optimizer_state must be"):
        jdp.strategies.exact(G, shard_optimizer_state="yes")
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=strategy(True)))
    state = step.replicate(jdp.TrainState.create(params=PARAMS, tx=optax.adafactor(1e-2)))
    with pytest.raises(ValueError, match=r"update applies `reduce_sum` across the elements"):
        step(state, step.shard(DATA[0]))  # adafactor's block-RMS clip reduces over a slice
    whole = jdp.pmap(jdp.make_train_step(models.mlp_loss, strategy=strategy(False)))
    split = step.replicate(jdp.TrainState.create(params=PARAMS, tx=optax.adam(1e-2)))
    with pytest.raises(TypeError, match=r"placed per replica"):
        whole(split, whole.shard(DATA[0]))


@pytest.mark.parametrize("family", ["cnn", "transformer"])
def test_zoo_families_split_are_the_unsplit_families_bits(family):
    """BatchNorm statistics, dropout, a dynamic loss scale (cnn); AdamW, per-token weights."""
    make_step, state, batches = zoo.FAMILIES[family]()
    expected, expected_metrics = check_exact(make_step, state, batches, device_counts=(1,))[1]
    make_step, state, batches = zoo.FAMILIES[f"{family}_split_optimizer"]()
    got, metrics = check_exact(make_step, state, batches, device_counts=(8,))[8]
    assert np.array_equal(metrics["loss"], expected_metrics["loss"])
    assert_bitwise((got.params, got.model_state), (expected.params, expected.model_state))
    assert_bitwise(got.opt_state, expected.opt_state)


def test_the_deprecated_arguments_name_the_split_when_both_are_asked_for():
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True to split"):
        jdp.make_train_step(models.mlp_loss, virtual_replicas=G, shard_optimizer=True)

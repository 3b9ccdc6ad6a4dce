"""Weight-update sharding (strategies.zero1()): 1/n of the optimizer per device, same numbers."""

import itertools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
# hidden=13: leaves of 78, 13 and 39 elements, so slices are padded at n = 2, 4 and 8.
PARAMS = models.mlp_params(hidden=13)
DATA = [models.regression_batch(32, seed=500 + i) for i in range(50)]


def decay_kernels(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=decay_kernels),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "clipped_adam": lambda: optax.chain(jdp.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


def train(tx, shard, backend, n, data=DATA, loss=models.mlp_loss):
    step = models.backend(
        backend, jdp.make_train_step(loss, strategy=jdp.strategies.zero1() if shard else None), n
    )
    state = step.replicate(jdp.TrainState.create(params=PARAMS, tx=tx))
    for batch in data:
        state, metrics = step(state, step.shard(batch))
    return step.unreplicate(state), metrics


def assert_close(actual, expected, rtol=1e-6):
    """rtol 1e-6, with an absolute floor of 1e-6 x the leaf's largest magnitude."""
    for (path, a), e in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True
    ):
        a, e = np.asarray(a), np.asarray(e)
        scale = float(np.max(np.abs(e))) if e.size and e.dtype.kind == "f" else 0.0
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fifty_steps_equal_the_replicated_step(name, backend):
    for n in (2, 4, 8):
        expected, expected_metrics = train(OPTIMIZERS[name](), False, backend, n)
        actual, metrics = train(OPTIMIZERS[name](), True, backend, n)
        assert jax.tree.structure(actual.opt_state) == jax.tree.structure(expected.opt_state)
        assert_close(actual.params, expected.params)
        assert_close(actual.opt_state, expected.opt_state)
        np.testing.assert_allclose(metrics["loss"], expected_metrics["loss"], rtol=1e-6)
    # and it trained
    assert float(metrics["loss"].mean()) < 0.9 * float(
        train(OPTIMIZERS[name](), True, backend, 8, data=DATA[:1])[1]["loss"].mean()
    )


def test_the_optimizer_state_is_one_nth_per_device():
    n = 8
    step = models.backend(
        "pmap", jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1()), n
    )
    big = {"w": jnp.ones((1001, 997)), "b": jnp.ones(997), "s": jnp.ones(())}
    state = step.replicate(jdp.TrainState.create(params=big, tx=optax.adam(1e-3)))
    assert isinstance(state.opt_state, jdp.ShardedOptState)

    def device0_bytes(tree):
        return sum(
            x.addressable_shards[0].data.nbytes
            for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array)
        )

    sharded = device0_bytes(state.opt_state)
    logical = sum(np.asarray(x).nbytes for x in jax.tree.leaves(step.unreplicate(state).opt_state))
    # mu and nu of w and b split (padded to a multiple of 8), the count and the
    # scalar's moments whole.
    whole = 3 * 4  # count (int32) + mu, nu of the scalar
    assert logical / n <= sharded <= logical / n * 1.01 + whole
    assert math.isclose(sharded, whole + 2 * 4 * (-(-1001 * 997 // n) + -(-997 // n)))


def test_compiled_peak_per_device_for_a_ten_million_parameter_adam_step():
    sizes = (2048, 2048, 2048, 1024)
    r = np.random.RandomState(0)
    params = {
        f"w{i}": jnp.asarray(r.randn(a, b).astype(np.float32) * 0.01)
        for i, (a, b) in enumerate(itertools.pairwise(sizes))
    }
    assert sum(x.size for x in jax.tree.leaves(params)) >= 10_000_000

    def loss(p, batch):
        h = batch["x"]
        for i in range(len(sizes) - 1):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(h**2)

    batch = {"x": np.ones((64, sizes[0]), np.float32)}
    peaks = {}
    for shard in (False, True):
        step = models.backend(
            "shard_map",
            jdp.make_train_step(loss, strategy=jdp.strategies.zero1() if shard else None),
            8,
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
        m = step.lower(state, step.shard(batch)).compile().memory_analysis()
        peaks[shard] = models.compiled_peak(m)
        del state
    assert peaks[True] <= 0.7 * peaks[False], peaks


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_a_skipped_step_leaves_the_sharded_state_bit_for_bit_unchanged(strategy, backend):
    chosen = getattr(jdp.strategies, strategy)()
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss, strategy=chosen), 4)
    state = step.replicate(
        jdp.TrainState.create(
            params=PARAMS, tx=optax.adam(1e-2), loss_scale=jdp.DynamicLossScale(2.0**15)
        )
    )
    for batch in DATA[:3]:
        state, _ = step(state, step.shard(batch))
    before = jax.device_get(step.unreplicate(state))
    bad = dict(DATA[3], y=DATA[3]["y"].copy())
    bad["y"][-1, 0] = np.inf  # one replica's gradient overflows: every replica skips
    state, metrics = step(state, step.shard(bad))
    after = jax.device_get(step.unreplicate(state))
    assert not np.asarray(metrics["grads_finite"]).any()
    assert int(after.skipped_steps) == 1 and int(after.step) == int(before.step) + 1
    for a, b in zip(
        jax.tree.leaves((before.params, before.opt_state)),
        jax.tree.leaves((after.params, after.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert float(after.loss_scale.loss_scale) == float(before.loss_scale.loss_scale) / 2


@pytest.mark.parametrize("sharded", ["zero1", "fsdp"])
def test_composes_with_model_state_rng_accumulation_and_weighted_losses(sharded, backend):
    variables = models.classifier_variables()
    data = [models.classification_batch(64, seed=600 + i) for i in range(8)]

    def run(name):
        step = models.backend(
            backend,
            jdp.make_train_step(
                models.classifier_train_loss,
                has_model_state=True,
                has_rng=True,
                strategy=getattr(jdp.strategies, name)(accumulate_steps=2),
                log_grad_norm=True,
            ),
            4,
        )
        state = step.replicate(
            jdp.TrainState.create(
                params=variables["params"],
                tx=optax.sgd(0.05, momentum=0.9),
                model_state=variables["batch_stats"],
                rng=jax.random.key(1),
            )
        )
        for batch in data:
            state, metrics = step(state, step.shard(batch))
        return jax.device_get(step.unreplicate(state)), metrics

    (expected, em), (actual, am) = run("data_parallel"), run(sharded)
    # The bias before the batch norm has a gradient of zero in exact arithmetic:
    # it holds rounding residue (|values| < 1e-8), which another summation order
    # (fsdp's reduce-scatter in the backward) leaves different. Other leaves: rtol 1e-6.
    bias = actual.params["Dense_0"].pop("bias"), expected.params["Dense_0"].pop("bias")
    np.testing.assert_allclose(*bias, rtol=0, atol=1e-8)
    assert_close(actual.params, expected.params)
    assert_close(actual.model_state, expected.model_state)
    np.testing.assert_allclose(am["grad_norm"], em["grad_norm"], rtol=1e-6)

    def token_loss(params, batch):
        err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jdp.weighted_mean(err, batch["mask"])

    masked = [dict(b, mask=(np.arange(32) % 3 != 0)) for b in DATA[:10]]
    for b in masked[:2]:
        b["mask"][:8] = False  # replica 0 of 4 holds no real example in these batches
    out = {}
    for name in ("data_parallel", sharded):
        step = models.backend(
            backend,
            jdp.make_train_step(token_loss, strategy=getattr(jdp.strategies, name)()),
            4,
        )
        state = step.replicate(jdp.TrainState.create(params=PARAMS, tx=optax.adam(1e-2)))
        for batch in masked:
            state, _ = step(state, step.shard(batch))
        out[name] = step.unreplicate(state).params
    assert_close(out[sharded], out["data_parallel"])


def test_transforms_that_reduce_over_a_slice_are_refused():
    step = models.backend(
        "pmap", jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1()), 4
    )
    batch = step.shard(DATA[0])
    refused = {
        "optax.clip_by_global_norm": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        "lamb": optax.lamb(1e-3),
        "lars": optax.lars(1e-3),
        "apply_if_finite": optax.apply_if_finite(optax.adam(1e-3), 3),
    }
    for name, tx in refused.items():
        state = step.replicate(jdp.TrainState.create(params=PARAMS, tx=tx))
        with pytest.raises(ValueError, match="silently different update") as info:
            step(state, batch)
        assert "jdp.clip_by_global_norm" in str(info.value), name
    # adafactor: small leaves get whole-leaf RMS clipping (refused when traced),
    # large ones factored moments, which a slice cannot hold (refused when placed).
    small = step.replicate(jdp.TrainState.create(params=PARAMS, tx=optax.adafactor(1e-3)))
    with pytest.raises(ValueError, match="silently different update"):
        step(small, batch)
    with pytest.raises(ValueError, match=r"shape \(256,\) for the whole parameters.*adafactor"):
        step.replicate(
            jdp.TrainState.create(params={"w": jnp.ones((256, 256))}, tx=optax.adafactor(1e-3))
        )


def test_misuse_gets_clear_errors():
    sharded = models.backend(
        "pmap", jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1()), 4
    )
    plain = models.backend("pmap", jdp.make_train_step(models.mlp_loss), 4)
    fresh = jdp.TrainState.create(params=PARAMS, tx=optax.adam(1e-3))
    batch = DATA[0]
    with pytest.raises(TypeError, match="step.replicate"):
        sharded(jdp.replicate(fresh, models.devices(4)), sharded.shard(batch))
    with pytest.raises(TypeError, match="placed per replica by another strategy.*unreplicate"):
        plain(sharded.replicate(fresh), plain.shard(batch))
    with pytest.raises(ValueError, match="already split"):
        sharded.replicate(sharded.replicate(fresh))
    other = models.backend(
        "pmap", jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.zero1()), 2
    )
    with pytest.raises(
        ValueError, match=r"replicated for 4 devices .* step.replicate\(step.unreplicate"
    ):
        other(sharded.replicate(fresh), other.shard(batch))
    # Replicas of the rest of the state are in sync; the split rows are skipped.
    jdp.assert_replicas_in_sync(sharded.replicate(fresh))


def test_checkpoints_hold_the_whole_state_and_cross_layouts_and_device_counts(tmp_path):
    tx = optax.adam(1e-2)
    fresh = jdp.TrainState.create(params=PARAMS, tx=tx)

    def make(shard, backend, n):
        return models.backend(
            backend,
            jdp.make_train_step(
                models.mlp_loss, strategy=jdp.strategies.zero1() if shard else None
            ),
            n,
        )

    first = make(True, "pmap", 8)
    state = first.replicate(fresh)
    for batch in DATA[:5]:
        state, _ = first(state, first.shard(batch))
    saved = jax.device_get(first.unreplicate(state))
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, state)
        ckpt.wait_until_finished()
        # The checkpoint holds the logical layout: it restores without any step.
        plain, _ = ckpt.restore(fresh)
        assert jax.tree.structure(plain.opt_state) == jax.tree.structure(fresh.opt_state)
        continued = {}
        for shard, backend, n in [
            (True, "pmap", 8),
            (False, "pmap", 8),
            (True, "shard_map", 4),
            (False, "shard_map", 4),
        ]:
            step = make(shard, backend, n)
            restored, _ = ckpt.restore(step.replicate(fresh))
            assert isinstance(restored.opt_state, jdp.ShardedOptState) == shard
            for a, b in zip(
                jax.tree.leaves(saved), jax.tree.leaves(step.unreplicate(restored)), strict=True
            ):
                np.testing.assert_array_equal(a, b)
            for batch in DATA[5:10]:
                restored, _ = step(restored, step.shard(batch))
            continued[(shard, n)] = jax.device_get(step.unreplicate(restored))
    # Sharded and replicated continuations agree (Adam is elementwise).
    for n in (8, 4):
        assert_close(continued[(True, n)], continued[(False, n)])
    # A replicated checkpoint restores into a sharded run, too.
    with jdp.Checkpointer(tmp_path / "replicated") as ckpt:
        replicated = make(False, "pmap", 8)
        ckpt.save(0, replicated.replicate(fresh))
        ckpt.wait_until_finished()
        step = make(True, "shard_map", 8)
        restored, _ = ckpt.restore(step.replicate(fresh))
        assert isinstance(restored.opt_state, jdp.ShardedOptState)


def test_two_processes_of_two_devices_equal_one_of_four(backend, tmp_path):
    out = {}
    for processes, devices in [(2, 2), (1, 4)]:
        path = tmp_path / f"{processes}x{devices}.npz"
        models.launch(
            "multiprocess_zero.py", processes, devices, path, backend, tmp_path / f"c{processes}"
        )
        out[processes] = np.load(path)
    assert set(out[1].files) == set(out[2].files)
    for name in out[1].files:
        np.testing.assert_allclose(out[2][name], out[1][name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_jdp_clip_with_leaves_too_small_to_split(backend):
    """A scalar temperature and a bias shorter than the device count stay whole on every
    replica: reducing over them is exact, so jdp's own clip is accepted and exact."""

    def loss(params, batch):
        return models.mlp_loss(params["mlp"], batch) * params["temperature"] + jnp.sum(
            params["bias"] ** 2
        )

    params = {"mlp": PARAMS, "temperature": jnp.float32(1.5), "bias": jnp.ones(3)}
    tx = optax.chain(jdp.clip_by_global_norm(0.5), optax.adam(1e-2))
    finals = []
    for strategy in (jdp.strategies.data_parallel(), jdp.strategies.zero1()):
        step = models.backend(backend, jdp.make_train_step(loss, strategy=strategy), 4)
        state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
        for batch in DATA[:10]:
            state, _ = step(state, step.shard(batch))
        finals.append(step.unreplicate(state))
    assert_close(finals[1].params, finals[0].params)
    assert_close(finals[1].opt_state, finals[0].opt_state)

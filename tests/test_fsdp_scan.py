"""fsdp(stacked=...): a model whose blocks run in a scan, each layer split and gathered on its own."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp.strategies import _slices
from tests import models
from tests.test_fsdp import LM_DATA, lm_tx
from tests.test_zero1 import assert_close

SCANNED = models.stacked(models.lm_params(layers=3))


def stacked_fsdp(**options):
    return jdp.strategies.fsdp(stacked=models.in_blocks, **options)


def train(strategy, backend, n, *, params=SCANNED, loss=models.lm_scan_loss, data=LM_DATA):
    step = models.backend(backend, jdp.make_train_step(loss, strategy=strategy), n)
    state = step.replicate(jdp.TrainState.create(params=params, tx=lm_tx()))
    for batch in data:
        state, metrics = step(state, step.shard(batch))
    return jax.device_get(step.unreplicate(state)), metrics, state


def assert_same_bits(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_each_layer_is_cut_on_its_own():
    x = np.arange(1.0, 16.0, dtype=np.float32).reshape(
        3, 5
    )  # 3 layers of 5 elements, 2 replicas: 3 + 3 (1 padding)
    record = _slices.PerLayer((3, 5))
    rows = np.asarray(_slices.split_rows(jnp.asarray(x), record, 2))
    assert rows.shape == (2, 3, 3)
    np.testing.assert_array_equal(rows[0], x[:, :3])
    np.testing.assert_array_equal(rows[1], np.concatenate([x[:, 3:], np.zeros((3, 1))], axis=1))
    np.testing.assert_array_equal(_slices.join_rows(rows, record), x)
    kernel = np.random.RandomState(0).randn(4, 6, 7).astype(np.float32)  # each row (L, 1, c)
    record = _slices.PerLayer(kernel.shape)
    rows = np.asarray(_slices.split_rows(jnp.asarray(kernel), record, 8))
    assert rows.shape == (8, 4, 1, 6)
    np.testing.assert_array_equal(_slices.join_rows(rows, record), kernel)
    np.testing.assert_array_equal(rows[:, 2].reshape(-1)[:42], kernel[2].reshape(-1))


def test_a_scanned_lm_trains_as_data_parallel_does(backend):
    """AdamW, warmup-cosine, jdp's global-norm clip and a decay mask, 20 steps."""
    for n in (1, 2, 4, 8):
        expected, em, _ = train(jdp.strategies.data_parallel(), backend, n)
        actual, am, state = train(stacked_fsdp(), backend, n)
        assert_close(actual.params, expected.params)
        assert_close(actual.opt_state, expected.opt_state)
        np.testing.assert_allclose(am["loss"], em["loss"], rtol=1e-6)
        if n > 1:  # each replica holds its slice of every layer: (n, L, 1, c)
            qkv = state.params.shards["blocks"]["qkv"]
            assert qkv.shape == (n, 3, 1, 16 * 48 // n)
            assert state.opt_state.logical_shapes.count(_slices.PerLayer((3, 16, 48))) == 2
    assert float(am["loss"].mean()) < 0.97 * float(models.lm_scan_loss(SCANNED, LM_DATA[-1]))


def test_stacked_with_accumulation_beside_leaves_gathered_whole(backend):
    """Micro-batches, and the embeddings gathered when the loss starts, beside the stacked blocks."""
    expected, em, _ = train(jdp.strategies.data_parallel(accumulate_steps=2), backend, 4)
    actual, am, _ = train(stacked_fsdp(accumulate_steps=2), backend, 4)
    assert_close(actual.params, expected.params)
    np.testing.assert_allclose(am["loss"], em["loss"], rtol=1e-6)


def test_gathering_one_layer_at_a_time_bounds_the_compiled_peak():
    """12 scanned blocks, Adam, 8 devices, a batch whose activations are small against the state."""
    params = models.stacked(models.lm_params(layers=12, d=128, vocab=256, seq=16))
    batch = models.lm_batch(16, vocab=256, seq=16)
    peaks = {}
    for name, strategy in [
        ("replicated", jdp.strategies.data_parallel()),
        ("whole", jdp.strategies.fsdp()),
        ("stacked", stacked_fsdp()),
    ]:
        step = models.backend(
            "shard_map", jdp.make_train_step(models.lm_scan_loss, strategy=strategy), 8
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
        m = step.lower(state, step.shard(batch)).compile().memory_analysis()
        peaks[name] = models.compiled_peak(m)
        if name == "stacked":
            block = sum(x.nbytes for x in jax.tree.leaves(params["blocks"])) // 12
            assert m.temp_size_in_bytes <= 2 * block + peaks[name] // 2, (m, block)
        del state
    assert peaks["stacked"] <= 0.25 * peaks["replicated"], peaks
    assert peaks["stacked"] < 0.6 * peaks["whole"], peaks


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h)), None


class Scanned(nn.Module):
    """A Linen model applying its blocks with nn.scan; each gathers its own parameters."""

    layers: int = 4
    width: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        gathered = nn.map_variables(Block, "params", trans_in_fn=jdp.strategies.gather, init=True)
        scan = nn.scan(
            nn.remat(gathered),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = scan(name="blocks")(x, None)
        return nn.Dense(1)(x)


def linen_setup(layers=4, width=16):
    model = Scanned(layers=layers, width=width)
    r = np.random.RandomState(0)
    data = [
        {"x": r.randn(16, 8).astype(np.float32), "y": r.randn(16, 1).astype(np.float32)}
        for _ in range(6)
    ]
    params = model.init(jax.random.key(0), data[0]["x"])["params"]

    def loss(params, batch):
        return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return params, loss, data


def test_a_linen_nn_scan_model_trains_as_data_parallel_does(backend):
    params, loss, data = linen_setup()
    for n in (2, 8):
        kwargs = {"params": params, "loss": loss, "data": data}
        expected, em, _ = train(jdp.strategies.data_parallel(), backend, n, **kwargs)
        actual, am, state = train(stacked_fsdp(), backend, n, **kwargs)
        assert_close(actual.params, expected.params)
        assert_close(actual.opt_state, expected.opt_state)
        np.testing.assert_allclose(am["loss"], em["loss"], rtol=1e-6)
        kernel = state.params.shards["blocks"]["Dense_0"]["kernel"]
        assert kernel.shape == (n, 4, 1, 16 * 64 // n)


def test_a_linen_nn_scan_model_holds_one_layer_at_a_time():
    params, loss, data = linen_setup(layers=12, width=256)
    peaks = {}
    for name, strategy in [
        ("replicated", jdp.strategies.data_parallel()),
        ("stacked", stacked_fsdp()),
    ]:
        step = models.backend("shard_map", jdp.make_train_step(loss, strategy=strategy), 8)
        state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
        peaks[name] = models.compiled_peak(
            step.lower(state, step.shard(data[0])).compile().memory_analysis()
        )
        del state
    assert peaks["stacked"] <= 0.25 * peaks["replicated"], peaks


def test_checkpoints_cross_strategies_device_counts_and_backends(tmp_path):
    fresh = jdp.TrainState.create(params=SCANNED, tx=optax.adam(1e-2))
    strategies = {
        "stacked": stacked_fsdp,
        "fsdp": jdp.strategies.fsdp,
        "zero1": jdp.strategies.zero1,
        "data_parallel": jdp.strategies.data_parallel,
    }

    def make(name, backend, n):
        step = jdp.make_train_step(models.lm_scan_loss, strategy=strategies[name]())
        return models.backend(backend, step, n)

    first = make("stacked", "pmap", 8)
    state = first.replicate(fresh)
    for batch in LM_DATA[:3]:
        state, _ = first(state, first.shard(batch))
    saved = jax.device_get(first.unreplicate(state))
    continued = {}
    with jdp.Checkpointer(tmp_path / "stacked") as ckpt:
        ckpt.save(3, state)
        ckpt.wait_until_finished()
        for name, backend, n in [
            ("stacked", "shard_map", 4),
            ("fsdp", "pmap", 2),
            ("zero1", "shard_map", 4),
            ("data_parallel", "shard_map", 8),
            ("data_parallel", "pmap", 1),
        ]:
            step = make(name, backend, n)
            restored, _ = ckpt.restore(step.replicate(fresh))
            assert_same_bits(saved, step.unreplicate(restored))
            for batch in LM_DATA[3:5]:
                restored, _ = step(restored, step.shard(batch))
            continued[(name, n)] = jax.device_get(step.unreplicate(restored))
    for value in continued.values():
        assert_close(value.params, continued[("data_parallel", 8)].params)
    with jdp.Checkpointer(tmp_path / "replicated") as ckpt:  # and the reverse
        ckpt.save(0, make("data_parallel", "pmap", 8).replicate(fresh))
        ckpt.wait_until_finished()
        step = make("stacked", "shard_map", 4)
        restored, _ = ckpt.restore(step.replicate(fresh))
        assert isinstance(restored.params.logical_shapes[0], _slices.PerLayer)
        assert_same_bits(fresh, step.unreplicate(restored))


def test_evaluate_and_sync_replicas_see_the_whole_parameters(backend):
    step = models.backend(
        backend, jdp.make_train_step(models.lm_scan_loss, strategy=stacked_fsdp()), 4
    )
    state = step.replicate(jdp.TrainState.create(params=SCANNED, tx=optax.adam(1e-3)))
    state, _ = step(state, step.shard(LM_DATA[0]))
    whole = jax.tree.map(jnp.asarray, jax.device_get(step.unreplicate(state)).params)

    def per_example(params, batch):
        one = lambda t: models.lm_scan_loss(params, {"tokens": t[None]})  # noqa: E731
        return {"loss": jax.vmap(one)(batch["tokens"])}

    evaluator = models.backend(backend, jdp.make_eval_step(per_example, strategy=stacked_fsdp()), 4)
    got = jdp.evaluate(evaluator, state, LM_DATA[1:3])["loss"]
    expected = np.mean([per_example(whole, b)["loss"] for b in LM_DATA[1:3]])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert_same_bits(step.unreplicate(jdp.sync_replicas(state)), step.unreplicate(state))


def test_two_processes_of_two_devices_equal_one_of_four(tmp_path):
    out = {}
    for processes, devices in [(2, 2), (1, 4)]:
        path = tmp_path / f"{processes}x{devices}.npz"
        models.launch(
            "multiprocess_zero.py",
            processes,
            devices,
            path,
            "shard_map",
            tmp_path / f"c{processes}",
            "fsdp_stacked",
        )
        out[processes] = np.load(path)
    assert set(out[1].files) == set(out[2].files)
    for name in out[1].files:
        np.testing.assert_allclose(out[2][name], out[1][name], rtol=1e-6, atol=1e-7, err_msg=name)


def whole_blocks_loss(params, batch):
    """A stacked leaf handed to layer() without a scan over it."""
    tokens = batch["tokens"]
    x = params["embed"][tokens[:, :-1]]
    return jnp.mean(jdp.strategies.layer(models.lm_block)(params["blocks"], x))


def test_misuse_gets_clear_errors():
    batch = LM_DATA[0]
    fresh = jdp.TrainState.create(params=SCANNED, tx=optax.adam(1e-3))
    with pytest.raises(TypeError, match="stacked must be a function of a parameter's key path"):
        jdp.strategies.fsdp(stacked="blocks")
    cases = [
        (
            whole_blocks_loss,
            stacked_fsdp(),
            r"has shape \(3, 1, 256\).*\(1, 256\).*holds every layer",
        ),
        # a scan slicing leaves that fsdp cut whole: a slice of no layer
        (models.lm_scan_loss, jdp.strategies.fsdp(layers=models.in_blocks), r"stacked=\.\.\."),
    ]
    for loss, strategy, message in cases:
        step = models.backend("shard_map", jdp.make_train_step(loss, strategy=strategy), 4)
        with pytest.raises(ValueError, match=message):
            step(step.replicate(fresh), step.shard(batch))

    def ungathered(params, batch):  # a stacked leaf used as an array in the scan's body
        def body(x, w):
            return x @ w["up"] @ w["down"], None

        y, _ = jax.lax.scan(body, jnp.ones((2, d)), params["blocks"])
        return jnp.mean(y)

    d = SCANNED["embed"].shape[1]
    step = models.backend("shard_map", jdp.make_train_step(ungathered, strategy=stacked_fsdp()), 4)
    used = rf"Shard: the loss used a split parameter of shape \({d}, {4 * d}\) as an array \(@\)"
    with pytest.raises(TypeError, match=used + r".*wrap that function in jdp.strategies.layer"):
        step(step.replicate(fresh), step.shard(batch))
    with pytest.raises(TypeError, match=r"layer takes the layer's function.*got 3 \(int\)"):
        jdp.strategies.layer(3)  # type: ignore[type-var]

    def gathered_whole(params, batch):
        return jnp.sum(jdp.strategies.gather(params["blocks"])["qkv"])

    step = models.backend(
        "shard_map", jdp.make_train_step(gathered_whole, strategy=stacked_fsdp()), 4
    )
    with pytest.raises(ValueError, match=r"jdp.strategies.gather: a parameter slice has shape"):
        step(step.replicate(fresh), step.shard(batch))


def test_gather_is_the_tree_itself_without_shards():
    tree = {"w": jnp.arange(3.0), "n": 2}
    np.testing.assert_array_equal(jdp.strategies.gather(tree)["w"], tree["w"])
    assert jdp.strategies.gather(tree)["n"] == 2


def test_a_failed_fit_resumes_from_the_survivors_rows_bitwise(tmp_path):
    from tests.test_survivors import fail_at, leaves

    data = models.lm_batch(256, seed=1)

    def fit(directory, callbacks=()):
        train_step = jdp.make_train_step(models.lm_scan_loss, strategy=stacked_fsdp())
        step = models.backend("pmap", train_step, 8, donate_state=False)
        state = step.replicate(jdp.TrainState.create(params=SCANNED, tx=optax.adam(1e-2)))
        with jdp.Checkpointer(directory / "ckpt", local_directory=directory / "local") as ckpt:
            return jdp.fit(
                step,
                state,
                jdp.BatchIterator(data, 16, seed=2),
                num_steps=12,
                checkpointer=ckpt,
                checkpoint_every=5,
                callbacks=callbacks,
                log_every=1,
                progress=False,
            )

    reference, _ = fit(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="failed at step 7"):
        fit(tmp_path / "run", callbacks=[fail_at(7)])
    state, history = fit(tmp_path / "run")
    assert history.resumed_at == [7]  # the survivors' copy, not checkpoint 5
    for got, expected in zip(leaves(state), leaves(reference), strict=True):
        np.testing.assert_array_equal(got, expected)

"""Fully sharded data parallelism (strategies.fsdp()): 1/n of everything per device, same numbers.

A skipped step, model state, rng, accumulation and weighted losses under fsdp:
tests/test_zero1.py (its tests take both sharded strategies).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models
from tests.test_zero1 import DATA, OPTIMIZERS, PARAMS, assert_close

LM = models.lm_params()
LM_DATA = [models.lm_batch(16, seed=10 + i) for i in range(20)]


def lm_tx():
    """AdamW on a warmup-cosine schedule, jdp's global-norm clip, decay on kernels only."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 20)
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    return optax.chain(
        jdp.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1, mask=mask)
    )


def train(strategy, backend, n, *, params=PARAMS, tx, data=DATA, loss=models.mlp_loss):
    step = models.backend(backend, jdp.make_train_step(loss, strategy=strategy), n)
    state = step.replicate(jdp.TrainState.create(params=params, tx=tx))
    for batch in data:
        state, metrics = step(state, step.shard(batch))
    return jax.device_get(step.unreplicate(state)), metrics


@pytest.mark.parametrize(
    "options",
    [{"layers": models.in_blocks}, {}, {"layers": models.in_blocks, "accumulate_steps": 2}],
    ids=["layer_by_layer", "whole_tree", "accumulate"],
)
def test_a_transformer_lm_trains_as_data_parallel_does(options, backend):
    # every device count for the layer-by-layer model; two for its variants
    for n in (1, 2, 4, 8) if options == {"layers": models.in_blocks} else (2, 8):
        kwargs = {"params": LM, "tx": lm_tx(), "data": LM_DATA, "loss": models.lm_loss}
        expected, em = train(jdp.strategies.data_parallel(), backend, n, **kwargs)
        kwargs["tx"] = lm_tx()
        actual, am = train(jdp.strategies.fsdp(**options), backend, n, **kwargs)
        assert jax.tree.structure(actual.opt_state) == jax.tree.structure(expected.opt_state)
        assert_close(actual.params, expected.params)
        assert_close(actual.opt_state, expected.opt_state)
        np.testing.assert_allclose(am["loss"], em["loss"], rtol=1e-6)
    # and it trained: the last batch's loss fell from the initial parameters'
    assert float(am["loss"].mean()) < 0.97 * float(models.lm_loss(LM, LM_DATA[-1]))


@pytest.mark.parametrize("name", ["momentum", "adamw_mask", "clipped_adam"])
def test_the_mlp_with_padded_slices_equals_data_parallel(name, backend):
    for n in (2, 4, 8):
        expected, em = train(jdp.strategies.data_parallel(), backend, n, tx=OPTIMIZERS[name]())
        actual, am = train(jdp.strategies.fsdp(), backend, n, tx=OPTIMIZERS[name]())
        assert_close(actual.params, expected.params)
        assert_close(actual.opt_state, expected.opt_state)
        np.testing.assert_allclose(am["loss"], em["loss"], rtol=1e-6)


def test_each_device_holds_one_nth_of_the_state():
    n = 8
    step = models.backend(
        "shard_map", jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.fsdp()), n
    )
    big = {"w1": jnp.ones((6, 1001)), "b1": jnp.ones(1001), "w2": jnp.ones((1001, 3))}
    state = step.replicate(jdp.TrainState.create(params=big, tx=optax.adam(1e-3)))
    assert isinstance(state.params, jdp.strategies.ShardedParams)

    def device0_bytes(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    logical = sum(np.asarray(x).nbytes for x in jax.tree.leaves(step.unreplicate(state)))
    held = device0_bytes(state)
    # params, mu and nu split (padded to a multiple of 8); the step, the count
    # and the other scalars of the state whole.
    assert logical / n <= held <= 1.01 * logical / n + 64


def test_layer_by_layer_gathering_bounds_the_compiled_peak():
    """12 blocks, Adam, 8 devices, a batch whose activations are small against the state."""
    params = models.lm_params(layers=12, d=128, vocab=256, seq=16)
    batch = models.lm_batch(16, vocab=256, seq=16)
    peaks = {}
    for name, strategy in [
        ("replicated", jdp.strategies.data_parallel()),
        ("whole", jdp.strategies.fsdp()),
        ("layers", jdp.strategies.fsdp(layers=models.in_blocks)),
    ]:
        step = models.backend(
            "shard_map", jdp.make_train_step(models.lm_loss, strategy=strategy), 8
        )
        state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
        m = step.lower(state, step.shard(batch)).compile().memory_analysis()
        peaks[name] = models.compiled_peak(m)
        if name == "layers":
            block = sum(x.nbytes for x in jax.tree.leaves(params["blocks"][0]))
            # two blocks whole at a time at most (one gathered ahead of its use)
            assert m.temp_size_in_bytes <= 2 * block + peaks[name] // 2, (m, block)
        del state
    assert peaks["layers"] <= 0.25 * peaks["replicated"], peaks
    assert peaks["layers"] < 0.6 * peaks["whole"], peaks


def test_evaluate_and_sync_replicas_see_the_whole_parameters(backend):
    strategy = jdp.strategies.fsdp(layers=models.in_blocks)
    step = models.backend(backend, jdp.make_train_step(models.lm_loss, strategy=strategy), 4)
    state = step.replicate(jdp.TrainState.create(params=LM, tx=optax.adam(1e-3)))
    state, _ = step(state, step.shard(LM_DATA[0]))
    whole = jax.tree.map(jnp.asarray, jax.device_get(step.unreplicate(state)).params)

    def per_example(params, batch):
        return {
            "loss": jax.vmap(lambda t: models.lm_loss(params, {"tokens": t[None]}))(batch["tokens"])
        }

    evaluator = models.backend(backend, jdp.make_eval_step(per_example, strategy=strategy), 4)
    got = jdp.evaluate(evaluator, state, LM_DATA[1:3])["loss"]
    expected = np.mean([per_example(whole, b)["loss"] for b in LM_DATA[1:3]])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    synced = jdp.sync_replicas(state)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(step.unreplicate(synced))),
        jax.tree.leaves(jax.device_get(step.unreplicate(state))),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_checkpoints_cross_strategies_device_counts_and_backends(tmp_path):
    fresh = jdp.TrainState.create(params=LM, tx=optax.adam(1e-2))
    strategies = {
        "fsdp": lambda: jdp.strategies.fsdp(layers=models.in_blocks),
        "zero1": jdp.strategies.zero1,
        "data_parallel": jdp.strategies.data_parallel,
    }

    def make(name, backend, n):
        step = jdp.make_train_step(models.lm_loss, strategy=strategies[name]())
        return models.backend(backend, step, n)

    first = make("fsdp", "pmap", 8)
    state = first.replicate(fresh)
    for batch in LM_DATA[:3]:
        state, _ = first(state, first.shard(batch))
    saved = jax.device_get(first.unreplicate(state))
    with jdp.Checkpointer(tmp_path / "fsdp") as ckpt:
        ckpt.save(3, state)
        ckpt.wait_until_finished()
        continued = {}
        for name, backend, n in [
            ("fsdp", "shard_map", 2),
            ("zero1", "pmap", 4),
            ("data_parallel", "shard_map", 8),
            ("data_parallel", "pmap", 1),
        ]:
            step = make(name, backend, n)
            restored, _ = ckpt.restore(step.replicate(fresh))
            for a, b in zip(
                jax.tree.leaves(saved), jax.tree.leaves(step.unreplicate(restored)), strict=True
            ):
                np.testing.assert_array_equal(a, b)
            for batch in LM_DATA[3:6]:
                restored, _ = step(restored, step.shard(batch))
            continued[(name, n)] = jax.device_get(step.unreplicate(restored))
    reference = continued[("data_parallel", 8)]
    for value in continued.values():
        assert_close(value.params, reference.params)
    # and the reverse: a replicated checkpoint restores into an fsdp step
    with jdp.Checkpointer(tmp_path / "replicated") as ckpt:
        ckpt.save(0, make("data_parallel", "pmap", 8).replicate(fresh))
        ckpt.wait_until_finished()
        step = make("fsdp", "shard_map", 4)
        restored, _ = ckpt.restore(step.replicate(fresh))
        assert isinstance(restored.params, jdp.strategies.ShardedParams)
        for a, b in zip(
            jax.tree.leaves(fresh), jax.tree.leaves(step.unreplicate(restored)), strict=True
        ):
            np.testing.assert_array_equal(a, b)


def test_two_processes_of_two_devices_equal_one_of_four(backend, tmp_path):
    out = {}
    for processes, devices in [(2, 2), (1, 4)]:
        path = tmp_path / f"{processes}x{devices}.npz"
        models.launch(
            "multiprocess_zero.py",
            processes,
            devices,
            path,
            backend,
            tmp_path / f"c{processes}",
            "fsdp",
        )
        out[processes] = np.load(path)
    assert set(out[1].files) == set(out[2].files)
    for name in out[1].files:
        np.testing.assert_allclose(out[2][name], out[1][name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_misuse_gets_clear_errors():
    sharded = models.backend(
        "pmap", jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.fsdp()), 4
    )
    plain = models.backend("pmap", jdp.make_train_step(models.mlp_loss), 4)
    fresh = jdp.TrainState.create(params=PARAMS, tx=optax.adam(1e-3))
    batch = DATA[0]
    with pytest.raises(TypeError, match=r"fsdp: the step needs the state split.*step.replicate"):
        sharded(jdp.replicate(fresh, models.devices(4)), sharded.shard(batch))
    with pytest.raises(TypeError, match="placed per replica by another strategy.*unreplicate"):
        plain(sharded.replicate(fresh), plain.shard(batch))
    with pytest.raises(ValueError, match="already split"):
        sharded.replicate(sharded.replicate(fresh))
    with pytest.raises(TypeError, match="layers must be a function of a parameter's key path"):
        jdp.strategies.fsdp(layers="blocks")

    def weighted(params, batch):
        err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jdp.weighted_mean(err, jnp.ones(err.shape[0]))

    summed = models.backend(
        "pmap", jdp.make_train_step(weighted, strategy=jdp.strategies.fsdp(reduce="sum")), 4
    )
    with pytest.raises(ValueError, match=r"fsdp\(reduce='sum'\) with a jdp.WeightedLoss"):
        summed(summed.replicate(fresh), summed.shard(batch))

    def strings(params, batch):  # a layer given a non-array argument
        layer = jdp.strategies.layer(lambda p, x, how: jnp.tanh(x @ p["w1"]))
        return jnp.mean(layer(params, batch["x"], "tanh"))

    odd = models.backend(
        "pmap",
        jdp.make_train_step(
            strings, strategy=jdp.strategies.fsdp(layers=lambda path: "w1" in path)
        ),
        4,
    )
    with pytest.raises(TypeError, match=r"arguments after params must be arrays.*partial"):
        odd(odd.replicate(fresh), odd.shard(batch))
    # Replicas of the rest of the state are in sync; the split rows are skipped.
    jdp.assert_replicas_in_sync(sharded.replicate(fresh))


def test_layer_is_the_function_itself_without_shards():
    block = jdp.strategies.layer(models.lm_block)
    x = jnp.ones((2, 8, 16))
    np.testing.assert_array_equal(block(LM["blocks"][0], x), models.lm_block(LM["blocks"][0], x))
    grads = jax.grad(lambda p: jnp.sum(block(p, x)))(LM["blocks"][0])
    expected = jax.grad(lambda p: jnp.sum(models.lm_block(p, x)))(LM["blocks"][0])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_layers_that_close_over_parameters_and_take_keys_train_as_data_parallel(backend):
    """A layer closing over the (tied) embedding gets its gradient through the closure; a
    dropout key passes through the layer as an argument."""

    def loss(params, batch, rng):
        embed = params["embed"]
        x = embed[batch["tokens"][:, :-1]]

        def block(p, x, key):
            keep = jax.random.bernoulli(key, 0.9, x.shape)
            mixed = models.lm_block(p, jnp.where(keep, x / 0.9, 0.0))
            return mixed + 0.1 * (x @ embed.T) @ embed  # closes over the tied table

        for i, p in enumerate(params["blocks"]):
            x = jdp.strategies.layer(block)(p, x, jax.random.fold_in(rng, i))
        logits = x @ embed.T
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    params = {"embed": LM["embed"], "blocks": LM["blocks"]}
    out = {}
    for name, strategy in [
        ("dp", jdp.strategies.data_parallel()),
        ("fsdp", jdp.strategies.fsdp(layers=models.in_blocks)),
    ]:
        step = models.backend(
            backend, jdp.make_train_step(loss, has_rng=True, strategy=strategy), 4
        )
        state = step.replicate(
            jdp.TrainState.create(params=params, tx=optax.adam(1e-2), rng=jax.random.key(3))
        )
        for batch in LM_DATA[:5]:
            state, _ = step(state, step.shard(batch))
        out[name] = jax.device_get(step.unreplicate(state)).params
    assert_close(out["fsdp"], out["dp"])
    moved = np.max(np.abs(np.asarray(out["fsdp"]["embed"]) - np.asarray(LM["embed"])))
    assert moved > 1e-3


def test_fit_evaluates_and_resumes_an_fsdp_run_under_another_strategy(tmp_path):
    """fit under fsdp on 8 devices to step 6, checkpointing; resumed to step 12 under
    data_parallel on 2 devices; against data_parallel on 8 devices throughout."""
    tokens = np.concatenate([b["tokens"] for b in LM_DATA])

    def run(strategy, n, num_steps, directory):
        step = models.backend(
            "shard_map", jdp.make_train_step(models.lm_loss, strategy=strategy), n
        )

        def per_example(params, batch):
            return {
                "loss": jax.vmap(lambda t: models.lm_loss(params, {"tokens": t[None]}))(
                    batch["tokens"]
                )
            }

        evaluator = models.backend(
            "shard_map", jdp.make_eval_step(per_example, strategy=strategy), n
        )
        state = step.replicate(jdp.TrainState.create(params=LM, tx=optax.adam(1e-2)))
        with jdp.Checkpointer(directory) as ckpt:
            return jdp.fit(
                step,
                state,
                jdp.BatchIterator({"tokens": tokens}, 16, seed=4),
                num_steps=num_steps,
                eval_step=evaluator,
                eval_data=lambda: [{"tokens": tokens[:32]}],
                eval_every=6,
                checkpointer=ckpt,
                checkpoint_every=6,
                log_every=3,
                progress=False,
            )

    layered = jdp.strategies.fsdp(layers=models.in_blocks)
    _, first = run(layered, 8, 6, tmp_path / "run")
    resumed, second = run(jdp.strategies.data_parallel(), 2, 12, tmp_path / "run")
    straight, reference = run(jdp.strategies.data_parallel(), 8, 12, tmp_path / "straight")
    assert_close(jax.device_get(resumed.params), jax.device_get(straight.params))
    # The resumed history carries the first run's evaluation at step 6.
    assert [r["step"] for r in second.eval] == [r["step"] for r in reference.eval] == [6, 12]
    np.testing.assert_allclose(first.eval[0]["loss"], reference.eval[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        [r["loss"] for r in second.eval], [r["loss"] for r in reference.eval], rtol=1e-5
    )

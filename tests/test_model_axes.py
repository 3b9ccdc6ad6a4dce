"""A data axis inside a larger mesh: jdp reduces over it, XLA partitions the model axes.

The reference is the same step on a 1-D mesh of the same number of replicas,
where nothing is split over a model axis.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jdp
import jdp.verify
from jdp import _standby
from tests import models

STRATEGIES = {
    "data_parallel": jdp.strategies.data_parallel,
    "zero1": jdp.strategies.zero1,
    "exact": lambda: jdp.strategies.exact(8),
}


def mesh_of(n, m):
    """``n`` replicas by ``m`` model shards; XLA partitions over ``model`` (Auto)."""
    return jax.make_mesh(
        (n, m),
        ("batch", "model"),
        axis_types=(AxisType.Explicit, AxisType.Auto),
        devices=jax.devices()[: n * m],
    )


def split_kernels(params, mesh):
    """Every matrix split by columns over ``model`` where they divide; the rest whole."""
    m = mesh.shape["model"]

    def spec(x):
        return (
            PartitionSpec(None, "model") if x.ndim == 2 and x.shape[1] % m == 0 else PartitionSpec()
        )

    return jax.device_put(params, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params))


def split_state(state, mesh):
    """The parameters split by :func:`split_kernels`, and the optimizer's moments alike."""
    opt_state = state.opt_state
    if not isinstance(opt_state, jdp.strategies.ShardedOptState):  # zero1 splits it over data
        opt_state = split_kernels(opt_state, mesh)
    return state.replace(params=split_kernels(state.params, mesh), opt_state=opt_state)


def lm_tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 3, 10)
    return optax.adamw(schedule, weight_decay=0.1)


def train(strategy, mesh, steps=6, split=True):
    step = jdp.shard_map(jdp.make_train_step(models.lm_loss, strategy=strategy), mesh=mesh)
    state = step.replicate(jdp.TrainState.create(params=models.lm_params(), tx=lm_tx()))
    if split:
        state = split_state(state, mesh)
    losses = []
    for i in range(steps):
        state, metrics = step(state, step.shard(models.lm_batch(16, seed=i)))
        losses.append(np.asarray(metrics["loss"]))
    return step, state, np.stack(losses)


def assert_same_bits(actual, expected):
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def one_d(n):
    return jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",))


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_kernels_split_over_a_model_axis_train_as_on_the_1d_mesh(strategy, shape):
    n, m = shape
    step, state, losses = train(STRATEGIES[strategy](), mesh_of(n, m))
    _, reference, reference_losses = train(STRATEGIES[strategy](), one_d(n), split=False)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-6)
    models.assert_trees_close(
        step.unreplicate(state).params, jdp.unreplicate(reference).params, rtol=1e-6, atol=1e-7
    )
    # The kernels stay split over the model axis after the update.
    assert state.params["blocks"][0]["up"].sharding.spec == PartitionSpec(None, "model")
    jdp.assert_replicas_in_sync(state)


def test_exact_mode_is_bitwise_the_same_on_any_data_axis_at_a_fixed_model_split():
    finals = [jdp.unreplicate(train(jdp.strategies.exact(8), mesh_of(n, 2))[1]) for n in (1, 2, 4)]
    for other in finals[1:]:
        assert_same_bits(finals[0], other)


def test_fsdp_on_a_mesh_with_a_model_axis_trains_as_on_the_1d_mesh():
    # fsdp splits the state over the data axis; XLA may still partition the
    # computation over the model axis, which reorders sums.
    _, state, losses = train(jdp.strategies.fsdp(), mesh_of(2, 4), split=False)
    _, reference, reference_losses = train(jdp.strategies.fsdp(), one_d(2), split=False)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-6)
    models.assert_trees_close(
        jdp.unreplicate(state).params, jdp.unreplicate(reference).params, rtol=1e-6, atol=1e-7
    )


def rows_over_model(state, mesh):
    """Every split row of an fsdp state (its params and Adam moments) split again over ``model``."""
    m = mesh.shape["model"]

    def one(x):
        if x.ndim >= 2 and x.shape[0] == mesh.shape["batch"] and x.shape[-1] % m == 0:
            spec = PartitionSpec("batch", *([None] * (x.ndim - 2)), "model")
            return jax.device_put(x, NamedSharding(mesh, spec))
        return x

    def again(node):
        return type(node)(jax.tree.map(one, node.shards), node.logical_shapes, node.num_shards)

    return state.replace(params=again(state.params), opt_state=again(state.opt_state))


def test_fsdp_rows_split_over_the_model_axis_train_and_restore_as_on_the_1d_mesh(tmp_path):
    """1/(n m) of each kernel per device: fsdp's rows over the data axis, each row over model."""
    mesh = mesh_of(2, 4)
    strategy = jdp.strategies.fsdp(layers=models.in_blocks)
    step = jdp.shard_map(jdp.make_train_step(models.lm_loss, strategy=strategy), mesh=mesh)
    fresh = jdp.TrainState.create(params=models.lm_params(), tx=lm_tx())
    state = rows_over_model(step.replicate(fresh), mesh)
    qkv = state.params.shards["blocks"][0]["qkv"]  # (16, 48): 768 elements, 96 per device
    assert qkv.addressable_shards[0].data.shape == (1, 1, 96)
    losses = []
    for i in range(6):
        state, metrics = step(state, step.shard(models.lm_batch(16, seed=i)))
        losses.append(np.asarray(metrics["loss"]))
    _, reference, reference_losses = train(jdp.strategies.fsdp(), one_d(2), split=False)
    np.testing.assert_allclose(np.stack(losses), reference_losses, rtol=1e-6)
    models.assert_trees_close(
        step.unreplicate(state), jdp.unreplicate(reference), rtol=1e-6, atol=1e-7
    )
    assert state.params.shards["blocks"][0]["qkv"].addressable_shards[0].data.shape == (1, 1, 96)
    with jdp.Checkpointer(tmp_path) as ckpt:  # a restore keeps the template's split
        ckpt.save(6, state)
        ckpt.wait_until_finished()
        restored, _ = ckpt.restore(rows_over_model(step.replicate(fresh), mesh))
    mu = restored.opt_state.shards[0].mu["blocks"][1]["up"]
    assert mu.sharding.spec == PartitionSpec("batch", None, "model")
    assert mu.addressable_shards[0].data.shape == (1, 1, 16 * 64 // 8)
    assert_same_bits(step.unreplicate(restored), step.unreplicate(state))


def split_leaf(rows, mesh):
    """A (3, 8) leaf split by columns over ``model``; replica i (data index i) holds rows[i]."""
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    where = jdp._layout.data_index(mesh, "batch")
    arrays = [
        jax.device_put(rows[where(d)][index], d)
        for d, index in sharding.addressable_devices_indices_map((3, 8)).items()
    ]
    return jax.make_array_from_single_device_arrays((3, 8), sharding, arrays)


def test_host_readers_read_a_split_leaf_whole_and_each_replica_apart():
    mesh = mesh_of(2, 4)
    value = np.arange(24, dtype=np.float32).reshape(3, 8)
    leaf = split_leaf([value, value], mesh)
    np.testing.assert_array_equal(np.asarray(jdp.unreplicate({"w": leaf})["w"]), value)
    host = _standby._host_copy({"w": leaf}, [None])
    assert host is not None
    np.testing.assert_array_equal(host[0]["leaf0"], value)
    jdp.assert_replicas_in_sync({"w": leaf})
    # One replica's column block differs: the check names replica 1, not a shard.
    other = value.copy()
    other[2, 5] += 1
    with pytest.raises(AssertionError, match=r"replica 1"):
        jdp.assert_replicas_in_sync({"w": split_leaf([value, other], mesh)})


def test_a_checkpoint_from_the_model_axis_mesh_restores_on_the_1d_mesh_bitwise(tmp_path):
    _, state, _ = train(jdp.strategies.exact(8), mesh_of(2, 4), steps=3)
    with jdp.Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(3, state)
        checkpoints.wait_until_finished()
        step = jdp.shard_map(
            jdp.make_train_step(models.lm_loss, strategy=jdp.strategies.exact(8)), mesh=one_d(8)
        )
        template = step.replicate(jdp.TrainState.create(params=models.lm_params(), tx=lm_tx()))
        flat, _ = checkpoints.restore(template)
        checkpoints.save(4, flat)
        checkpoints.wait_until_finished()
        # and back onto another mesh with a model axis, from the 1-D mesh's checkpoint
        other = jdp.shard_map(step.step, mesh=mesh_of(4, 2))
        template = other.replicate(jdp.TrainState.create(params=models.lm_params(), tx=lm_tx()))
        back, _ = checkpoints.restore(template, 4)
    for restored in (flat, back):
        assert_same_bits(jdp.unreplicate(restored), jdp.unreplicate(state))
    assert back.params["head"].sharding.mesh.axis_names == ("batch", "model")


def test_sync_and_restore_keep_the_template_s_split(tmp_path):
    mesh = mesh_of(2, 4)
    _, state, _ = train(jdp.strategies.exact(8), mesh, steps=2)
    split = NamedSharding(mesh, PartitionSpec(None, "model"))
    synced = jdp.sync_replicas(state)
    with jdp.Checkpointer(tmp_path) as checkpoints:
        checkpoints.save(2, state)
        checkpoints.wait_until_finished()
        restored, _ = checkpoints.restore(state)
    for tree in (synced, restored):
        assert tree.params["blocks"][1]["up"].sharding == split
        assert_same_bits(jdp.unreplicate(tree), jdp.unreplicate(state))


def test_the_audit_agrees_on_every_clean_step_of_the_model_axis_mesh():
    mesh = mesh_of(2, 4)
    step = jdp.shard_map(
        jdp.make_train_step(models.lm_loss, audit=jdp.Audit(every=1, on_mismatch="raise")),
        mesh=mesh,
    )
    state = step.replicate(jdp.TrainState.create(params=models.lm_params(), tx=optax.adam(1e-3)))
    state = split_state(state, mesh)
    for i in range(3):
        state, metrics = step(state, step.shard(models.lm_batch(16, seed=i)))
        assert np.asarray(metrics["audit"]).tolist() == [[i + 1, -1, -1, 2]] * 2
    step.check_audit()


def test_a_mesh_without_the_data_axis_is_refused_by_name():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"^jdp.shard_map: the mesh has no data axis 'batch'"):
        jdp.shard_map(jdp.make_train_step(models.mlp_loss), mesh=mesh)


def test_the_batch_splits_over_the_data_axis_only():
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss), mesh=mesh_of(2, 4))
    batch = step.shard(models.regression_batch(6))  # 6 divides over 2 replicas, not 8 devices
    assert batch["x"].sharding.spec == PartitionSpec("batch")
    with pytest.raises(ValueError, match=r"B=5 examples over n=2"):
        step.shard(models.regression_batch(5))
    assert jnp.shape(batch["x"]) == (6, 6)


def per_example_loss(params, batch):
    one = lambda tokens: models.lm_loss(params, {"tokens": tokens[None]})  # noqa: E731
    return {"loss": jax.vmap(one)(batch["tokens"])}


def test_fit_with_evaluation_and_a_checkpoint_resumes_to_the_same_bits(tmp_path):
    mesh = mesh_of(2, 4)
    step = jdp.shard_map(
        jdp.make_train_step(models.lm_loss, strategy=jdp.strategies.exact(8)), mesh=mesh
    )
    evaluate = jdp.shard_map(jdp.make_eval_step(per_example_loss), mesh=mesh)
    batches = [models.lm_batch(16, seed=i) for i in range(6)]

    def fit(num_steps, directory):
        state = step.replicate(jdp.TrainState.create(params=models.lm_params(), tx=lm_tx()))
        with jdp.Checkpointer(directory) as checkpoints:
            return jdp.fit(
                step,
                state,
                batches[int(checkpoints.latest_step() or 0) :],
                num_steps=num_steps,
                eval_step=evaluate,
                eval_data=lambda: batches[:2],
                eval_every=2,
                checkpointer=checkpoints,
                checkpoint_every=2,
                progress=False,
            )

    whole, history = fit(6, tmp_path / "whole")
    fit(4, tmp_path / "resumed")
    with pytest.warns(RuntimeWarning, match=r"the data starts over"):  # fit() slices it itself
        resumed, _ = fit(6, tmp_path / "resumed")
    assert [row["step"] for row in history.eval] == [2, 4, 6]
    assert_same_bits(jdp.unreplicate(whole), jdp.unreplicate(resumed))


def test_host_callbacks_are_refused_by_name_where_the_model_axes_are_automatic():
    # JAX runs no callback under a partly automatic shard_map; fit's timed
    # twin and the replay's fingerprints both call the host.
    step = jdp.shard_map(jdp.make_train_step(models.lm_loss), mesh=mesh_of(2, 4))
    state = step.replicate(jdp.TrainState.create(params=models.lm_params(), tx=lm_tx()))
    batches = [models.lm_batch(16)]
    with pytest.raises(ValueError, match=r"^jdp.fit: time_every=1 stamps the step with host"):
        jdp.fit(step, state, batches, num_steps=1, progress=False, time_every=1)
    with pytest.raises(ValueError, match=r"^jdp.verify.replay: step_a runs on a mesh with model"):
        jdp.verify.replay(step, step, jdp.unreplicate(state), batches)


def test_exact_recomputation_pins_twenty_random_faults_on_the_replica_that_made_them():
    from tests import test_recompute as recompute

    mesh = mesh_of(4, 2)
    step = jdp.shard_map(recompute.per_replica(), mesh=mesh)
    start = jdp.TrainState.create(params=models.mlp_params(hidden=16), tx=optax.adam(1e-2))
    rng = np.random.default_rng(12)
    for trial in range(20):
        fault, expected = recompute.random_fault(rng, 4)
        state = step.replicate(start)
        state = split_state(state, mesh)
        for i in range(fault.step):
            rows = fault.rows(recompute.BATCH) if i + 1 == fault.step else None
            rows = jdp.testing.no_fault(recompute.BATCH) if rows is None else rows
            state, metrics = step(state, step.shard((recompute.DATA[i], rows)))
        assert recompute.first(metrics["recompute"]) == expected, (trial, fault)
        with pytest.raises(jdp.ReplicaMismatchError) as caught:
            step.check_audit()
        # A replica is named by the first device of its model group.
        culprit = jax.devices()[2 * fault.replica]
        assert f"at step {fault.step}, virtual replica {expected[1]}'s" in str(caught.value)
        assert f"device {fault.replica} computed wrong" in str(caught.value), trial
        assert f"device {fault.replica} ({culprit}, process 0)" in str(caught.value), trial


def test_two_processes_of_two_devices_give_one_process_s_bits(tmp_path):
    results = {}
    for processes, devices in ((2, 2), (1, 4)):
        out = tmp_path / f"{processes}x{devices}"
        models.launch("model_axes_processes.py", processes, devices, out)
        results[processes] = np.load(f"{out}.npz")
    assert set(results[1].files) == set(results[2].files)
    for name in results[1].files:
        assert np.array_equal(results[1][name], results[2][name]), name


def test_per_replica_metrics_read_as_on_the_1d_mesh():
    # Split over the data axis and copied over "model", a metric must not read as one
    # replicated value: unreplicate gives replica 0's, and the replicas differ.
    out = {}
    for name, mesh in (("flat", one_d(2)), ("model", mesh_of(2, 4))):
        step = jdp.shard_map(jdp.make_train_step(models.lm_loss), mesh=mesh)
        state = step.replicate(jdp.TrainState.create(params=models.lm_params(), tx=lm_tx()))
        _, metrics = step(state, step.shard(models.lm_batch(16)))
        out[name] = metrics
        with pytest.raises(AssertionError, match=r"leaf \['loss'\]: replica 1 differs"):
            jdp.assert_replicas_in_sync(metrics)
    assert np.shape(jdp.unreplicate(out["model"])["loss"]) == ()
    np.testing.assert_array_equal(
        jdp.gather_replicas(out["model"])["loss"], jdp.gather_replicas(out["flat"])["loss"]
    )
    assert float(jdp.unreplicate(out["model"])["loss"]) == float(
        jdp.unreplicate(out["flat"])["loss"]
    )

"""jdp.verify.replay: a step replayed on two configurations names the first phase that differs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
import jdp.verify
from jdp import _phases, _replay
from jdp.testing import Fault, with_faults
from tests import models

BATCHES = [models.regression_batch(16, seed=s) for s in range(3)]


def mlp_state(tx=None):
    return jdp.TrainState.create(params=models.mlp_params(), tx=tx or optax.adam(1e-2))


def step(n, backend="shard_map", strategy=None, wrap=None):
    built = jdp.make_train_step(models.mlp_loss, strategy=strategy or jdp.strategies.exact(8))
    return models.backend(backend, wrap(built) if wrap else built, n)


def leaf_path(tree, index):
    return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][index][0])


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_exact_mode_replays_bitwise_in_every_phase_on_any_device_count_and_backend(n, backend):
    assert jdp.verify.replay(step(8), step(n, backend), mlp_state(), BATCHES) is None


@pytest.mark.parametrize("n", [2, 8])
def test_a_gradient_fault_is_named_in_the_forward_backward_phase(n, backend):
    r = np.random.RandomState(n)
    for _ in range(2):
        leaf, virtual_replica = int(r.randint(3)), int(r.randint(8))
        fault = Fault(
            step=int(r.randint(1, 4)),
            replica=virtual_replica // (8 // n),  # the device that computes it
            leaf=leaf,
            index=int(r.randint(64)),
            bit=int(r.randint(32)),
            virtual_replica=virtual_replica,
        )
        faulty = step(n, backend, wrap=lambda s: with_faults(s, "gradients"))
        rows = [(b, fault.rows(16)) for b in BATCHES]
        found = jdp.verify.replay(step(n, backend), faulty, mlp_state(), BATCHES, batches_b=rows)
        name = "['grads']" + leaf_path(models.mlp_params(), leaf)
        assert found == jdp.verify.PhaseDifference(fault.step, "forward/backward", (name,), ())


def test_a_state_fault_is_named_after_the_update_with_its_replica(backend):
    state = mlp_state()
    fault = Fault(step=2, replica=5, leaf=3, index=4, bit=30)
    rows = [(b, fault.rows(16)) for b in BATCHES]
    faulty = step(8, backend, wrap=with_faults)
    found = jdp.verify.replay(step(8, backend), faulty, state, BATCHES, batches_b=rows)
    assert found == jdp.verify.PhaseDifference(
        2, "after the update", (leaf_path(state, 3),), (("b", 5),)
    )


def test_a_reduction_in_bfloat16_differs_in_the_reduction_phase_only():
    bf16 = jdp.strategies.data_parallel(
        communication=jdp.strategies.cast_communication(jnp.bfloat16)
    )
    found = jdp.verify.replay(
        step(8, strategy=jdp.strategies.data_parallel()),
        step(8, strategy=bf16),
        mlp_state(),
        BATCHES,
    )
    grads = tuple("['grads']" + leaf_path(models.mlp_params(), i) for i in range(3))
    assert found == jdp.verify.PhaseDifference(1, "reduction", grads, ())


def test_zero1_matches_data_parallel_in_every_phase_and_parts_in_the_update_under_a_clip():
    whole = step(8, strategy=jdp.strategies.data_parallel())
    zero1 = step(8, strategy=jdp.strategies.zero1())
    assert jdp.verify.replay(whole, zero1, mlp_state(), BATCHES) is None
    # The global norm sums the squares of the slices in another order.
    clipped = mlp_state(optax.chain(jdp.clip_by_global_norm(1e-3), optax.sgd(0.1)))
    found = jdp.verify.replay(whole, zero1, clipped, BATCHES)
    assert (found.step, found.phase, found.replicas) == (1, "update", ())
    assert found.leaves[0] == ".params['b1']"


def test_exact_mode_against_one_all_reduce_parts_in_the_reduction():
    # At n = G each device computes one virtual replica: the same gradients as
    # data_parallel's replicas, summed in a fixed tree instead of one all-reduce.
    dp, exact = jdp.strategies.data_parallel(), jdp.strategies.exact(8)
    found = jdp.verify.replay(step(8, strategy=dp), step(8, strategy=exact), mlp_state(), BATCHES)
    grads = tuple("['grads']" + leaf_path(models.mlp_params(), i) for i in range(3))
    assert found == jdp.verify.PhaseDifference(1, "reduction", grads, ())


def test_fsdp_gradients_leave_the_backward_pass_already_reduced():
    dp, fsdp = jdp.strategies.data_parallel(), jdp.strategies.fsdp()
    found = jdp.verify.replay(step(8, strategy=dp), step(8, strategy=fsdp), mlp_state(), BATCHES)
    assert (found.step, found.phase) == (1, "forward/backward")
    assert found.leaves == tuple("['grads']" + leaf_path(models.mlp_params(), i) for i in range(3))


def test_data_parallel_on_two_device_counts_parts_in_the_forward_backward_phase():
    dp = jdp.strategies.data_parallel()
    found = jdp.verify.replay(step(4, strategy=dp), step(8, strategy=dp), mlp_state(), BATCHES)
    assert (found.step, found.phase) == (1, "forward/backward")


def test_observing_a_step_changes_no_bit_and_an_ordinary_step_holds_no_callback():
    runner = step(4, strategy=jdp.strategies.zero1())
    plain, _ = runner(runner.replicate(mlp_state()), runner.shard(BATCHES[0]))
    watched = runner.with_step(runner.step)
    record = _phases.Record()
    observed, phases = _replay.run_observed(
        watched, watched.replicate(mlp_state()), BATCHES[0], record
    )
    assert set(phases) == set(_phases.PHASES) and set(phases["update"]) == set(range(4))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(observed), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    text = runner.lower(runner.replicate(mlp_state()), runner.shard(BATCHES[0])).as_text()
    assert "callback" not in text


def test_replay_refuses_what_it_cannot_replay():
    good = step(2)
    with pytest.raises(TypeError, match="step_a must be a training step wrapped by a backend"):
        jdp.verify.replay(jdp.make_train_step(models.mlp_loss), good, mlp_state(), BATCHES)
    with pytest.raises(TypeError, match="state must be a jdp.TrainState"):
        jdp.verify.replay(good, good, models.mlp_params(), BATCHES)
    with pytest.raises(TypeError, match="batches must be a list of global batches"):
        jdp.verify.replay(good, good, mlp_state(), iter(BATCHES))
    with pytest.raises(ValueError, match="batches is empty"):
        jdp.verify.replay(good, good, mlp_state(), [])
    with pytest.raises(ValueError, match="batches_b has length 1 and batches 3"):
        jdp.verify.replay(good, good, mlp_state(), BATCHES, batches_b=BATCHES[:1])
    plain = models.backend("shard_map", lambda s, b: (s, {}), 2)
    with pytest.raises(ValueError, match="the steps marked no phase"):
        jdp.verify.replay(plain, plain, mlp_state(), BATCHES)
    # An aux metric more: the forward/backward phase holds another leaf.
    with_aux = jdp.make_train_step(
        lambda p, b: (models.mlp_loss(p, b), {"y": jnp.mean(b["y"])}), has_aux=True
    )
    other = models.backend("shard_map", with_aux, 2)
    with pytest.raises(ValueError, match="phases hold different leaves"):
        jdp.verify.replay(
            step(2, strategy=jdp.strategies.data_parallel()), other, mlp_state(), BATCHES
        )

"""Exact mode's recompute_every: a device that computes wrong gradients is named.

The reference is exact mode's own guarantee: a virtual replica's gradients
are the same bits on any device, so the check must agree on clean steps, and
change nothing; a bit flipped in one device's computation (the injector's
``target="gradients"``) must be found and pinned on that device.
"""

import functools
import warnings

import jax
import numpy as np
import optax
import pytest

import jdp
from tests import models, zoo

BATCH = 32
G = 8
DATA = [models.regression_batch(BATCH, seed=900 + i) for i in range(8)]
GRAD_LEAVES = ["['b1']", "['w1']", "['w2']"]  # jax.tree.leaves order of mlp_params


@functools.cache  # one optimizer value: a new one is a new pytree node, so a new compile
def initial_state():
    return jdp.TrainState.create(params=models.mlp_params(hidden=13), tx=optax.adam(1e-2))


def per_replica(every=1, audit=None, faults=True):
    strategy = jdp.strategies.exact(G, recompute_every=every)
    step = jdp.make_train_step(models.mlp_loss, strategy=strategy, audit=audit)
    return jdp.testing.with_faults(step, target="gradients") if faults else step


def checked(backend, n, every=1, audit=None, faults=True):
    return models.backend(backend, per_replica(every, audit, faults), n)


def run(step, state, batches):
    metrics = []
    for batch in batches:
        state, m = step(state, step.shard(batch))
        metrics.append(first(m["recompute"]))
    return state, metrics


def first(metric):
    """Replica 0's row (the same on every replica), read where this process holds it."""
    return np.asarray(metric.addressable_shards[0].data).reshape(-1).tolist()


def clean(i):
    return (DATA[i % len(DATA)], jdp.testing.no_fault(BATCH))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_check_changes_no_bit_and_agrees_on_clean_steps(backend, n):
    plain = models.backend(
        backend, jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(G)), 1
    )
    reference, _ = plain.replicate(initial_state()), None
    for batch in DATA[:6]:
        reference, _ = plain(reference, plain.shard(batch))
    step = checked(backend, n, every=3, faults=False)
    state, metrics = run(step, step.replicate(initial_state()), DATA[:6])
    step.check_audit()
    # Steps 3 and 6 are checked and agree; the others are not checked.
    assert [m[:2] for m in metrics] == [[1, -2], [2, -2], [3, -1], [4, -2], [5, -2], [6, -1]]
    assert all(m[2:] == [m[1]] * 5 for m in metrics)
    ours = jax.tree.leaves(step.unreplicate(state))
    for a, b in zip(ours, jax.tree.leaves(plain.unreplicate(reference)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_host_chooses_the_checked_steps_and_the_others_run_none_of_it(backend):
    """recompute_every=4 from a state at step 6: steps 8 and 12 are checked; the other steps'
    compilation moves no micro-batch to a neighbour; the bits are exact(G)'s."""
    plain = models.backend(
        backend, jdp.make_train_step(models.mlp_loss, strategy=jdp.strategies.exact(G)), 8
    )
    step = checked(backend, 8, every=4, faults=False)
    start = initial_state().replace(step=jax.numpy.asarray(6, jax.numpy.int32))
    state, metrics = run(step, step.replicate(start), DATA[:6])
    step.check_audit()
    assert [m[:2] for m in metrics] == [[7, -2], [8, -1], [9, -2], [10, -2], [11, -2], [12, -1]]
    batch = step.shard(DATA[0])
    assert sorted(map(sorted, step._twins)) == [[], ["recompute"]]
    assert "collective_permute" not in step._twins[frozenset()].lower(state, batch).as_text()
    assert "collective_permute" in step.lower(state, batch).as_text()  # the graph's own choice
    reference = plain.replicate(start)
    for b in DATA[:6]:
        reference, _ = plain(reference, plain.shard(b))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def random_fault(rng, n, every=1):
    """A fault on the owner or the recomputer of a checked virtual replica; the expected row."""
    per_device = G // n
    at = int(rng.integers(1, 4)) * every
    owner = int(rng.integers(n))
    row = (at // every) % per_device
    replica = (owner + int(rng.integers(2))) % n
    leaf = int(rng.integers(len(GRAD_LEAVES)))
    fault = jdp.testing.Fault(
        at,
        replica,
        leaf,
        index=int(rng.integers(100)),
        bit=int(rng.integers(32)),
        virtual_replica=owner * per_device + row,
    )
    vr = owner * per_device + row
    expected = [at, vr, owner, (owner + 1) % n, (owner + 2) % n, replica, leaf]
    return fault, expected


def faulty_run(step, fault, every=1):
    state, found = step.replicate(initial_state()), None
    for i in range(fault.step):
        rows = fault.rows(BATCH) if i + 1 == fault.step else jdp.testing.no_fault(BATCH)
        state, m = step(state, step.shard((DATA[i], rows)))
        row = first(m["recompute"])
        if row[1] >= 0 and found is None:
            found = row
    return found


def test_a_hundred_random_faults_are_pinned_on_the_device_that_made_them(backend):
    step = checked(backend, 8)
    rng = np.random.default_rng(11)
    for trial in range(100):
        fault, expected = random_fault(rng, 8)
        with pytest.raises(jdp.ReplicaMismatchError) as caught:
            assert faulty_run(step, fault) == expected, (trial, fault)
            step.check_audit()
        culprit = models.devices(8)[fault.replica]
        message = str(caught.value)
        assert message.startswith(
            f"jdp.strategies.exact: at step {fault.step}, virtual replica {expected[1]}'s "
            f"gradients computed on its own device {expected[2]} ("
        ), trial
        assert f"first at grads{GRAD_LEAVES[fault.leaf]};" in message
        assert f"device {fault.replica} ({culprit}, process 0)" in message
        assert f": device {fault.replica} computed wrong (silent data corruption)" in message


@pytest.mark.parametrize("n", [2, 4])
def test_faults_are_pinned_on_fewer_devices_and_between_checks(backend, n):
    step = checked(backend, n, every=2)
    rng = np.random.default_rng(12 + n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read from the metrics and the error
        for trial in range(12):
            fault, expected = random_fault(rng, n, every=2)
            with pytest.raises(jdp.ReplicaMismatchError):
                assert faulty_run(step, fault) == expected, (trial, fault)
                step.check_audit()


def test_the_messages_say_whose_gradients_reached_the_update(backend):
    step = checked(backend, 8)
    owner = jdp.testing.Fault(step=1, replica=5, leaf=2, index=3, bit=1, virtual_replica=5)
    with pytest.raises(jdp.ReplicaMismatchError) as caught:
        faulty_run(step, owner)
        step.check_audit()
    assert "device 7 (" in str(caught.value) and "agreed with the recomputation" in str(
        caught.value
    )
    assert "its gradients went into this step's update on every replica" in str(caught.value)
    recomputer = jdp.testing.Fault(step=1, replica=6, leaf=0, index=0, bit=9, virtual_replica=5)
    with pytest.raises(jdp.ReplicaMismatchError) as caught:
        faulty_run(step, recomputer)
        step.check_audit()
    assert "agreed with device 5: device 6 computed wrong (silent data corruption) in the " in str(
        caught.value
    )
    assert "the update used the right gradients" in str(caught.value)


def test_what_the_check_cannot_see(backend):
    """A fault in a virtual replica not checked this step: found by nothing (docs/audit.md)."""
    step = checked(backend, 4)  # 2 virtual replicas per device; step 1 checks row 1
    unseen = jdp.testing.Fault(step=1, replica=2, leaf=1, index=0, bit=30, virtual_replica=4)
    state, metrics = run(step, step.replicate(initial_state()), [(DATA[0], unseen.rows(BATCH))])
    step.check_audit()
    assert metrics == [[1, -1, -1, -1, -1, -1, -1]]
    clean_step = checked(backend, 4)
    reference, _ = run(clean_step, clean_step.replicate(initial_state()), [clean(0)])
    w1 = [np.asarray(jdp.unreplicate(s).params["w1"]) for s in (state, reference)]
    assert not np.array_equal(*w1)  # the fault reached the update, unseen


def test_warn_goes_on_and_fit_saves_no_failed_step(backend, tmp_path):
    step = checked(backend, 8, audit=jdp.Audit(on_mismatch="warn"))
    fault = jdp.testing.Fault(step=2, replica=3, leaf=1, index=0, bit=25, virtual_replica=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, metrics = run(
            step,
            step.replicate(initial_state()),
            [clean(0), (DATA[1], fault.rows(BATCH)), clean(2)],
        )
        step.check_audit()
    assert [str(w.message)[:62] for w in caught] == [
        "jdp.strategies.exact: at step 2, virtual replica 2's gradients"
    ]
    assert metrics[2] == [3, -1, -1, -1, -1, -1, -1]
    raising = checked(backend, 8)
    ckpt = jdp.Checkpointer(tmp_path / "ckpt")
    data = [
        (DATA[i], fault.rows(BATCH) if i == 1 else jdp.testing.no_fault(BATCH)) for i in range(4)
    ]
    with pytest.raises(jdp.ReplicaMismatchError, match="at step 2, virtual replica 2"):
        jdp.fit(
            raising,
            raising.replicate(initial_state()),
            data,
            num_steps=4,
            checkpointer=ckpt,
            checkpoint_every=1,
            progress=False,
        )
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 1


def test_arguments_are_checked():
    with pytest.raises(
        ValueError, match=r"jdp.strategies.exact: recompute_every must be an int >= 1, got 0"
    ):
        jdp.strategies.exact(8, recompute_every=0)
    with pytest.raises(TypeError, match=r"recompute_every must be an int >= 1, got True"):
        jdp.strategies.exact(8, recompute_every=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"target='gradients' needs a step in exact mode"):
        jdp.testing.with_faults(jdp.make_train_step(models.mlp_loss), target="gradients")
    with pytest.raises(ValueError, match=r"target must be 'state' or 'gradients', got 'grads'"):
        jdp.testing.with_faults(jdp.make_train_step(models.mlp_loss), target="grads")
    with pytest.raises(TypeError, match=r"target must be a string, 'state' or 'gradients', got 1"):
        jdp.testing.with_faults(jdp.make_train_step(models.mlp_loss), target=1)  # type: ignore[arg-type]


def test_an_aux_named_recompute_is_refused(backend):
    def loss(params, batch):
        return models.mlp_loss(params, batch), {"recompute": jax.numpy.zeros(())}

    strategy = jdp.strategies.exact(G, recompute_every=1)
    step = models.backend(backend, jdp.make_train_step(loss, strategy=strategy, has_aux=True), 8)
    with pytest.raises(ValueError, match=r"aux keys \['recompute'\] are reserved for exact mode"):
        step(step.replicate(initial_state()), step.shard(DATA[0]))


def test_faults_across_two_processes_are_pinned(tmp_path):
    out = tmp_path / "found.npz"
    models.launch("multiprocess_audit.py", 2, 2, out, "recompute")
    found = np.load(out)["found"].tolist()
    processes = np.load(out)["processes"].tolist()
    assert len(found) == 20
    for expected, got in found:
        assert got == expected
    assert {processes[e[5]] for e, _ in found} == {0, 1}  # culprits on both processes


@pytest.mark.parametrize(
    "family", ["mlp", "cnn", "transformer", "nnx", "moe_counter", "weight_zero_step"]
)
def test_zoo_families_agree_when_checked_and_keep_their_bits(family, monkeypatch):
    """Dropout keys, batch norm, a loss scale, a weighted loss, NNX RNG state, int32 state, weight 0."""
    make_plain, state, batches = zoo.FAMILIES[family]()
    exact = jdp.strategies.exact
    monkeypatch.setattr(jdp.strategies, "exact", functools.partial(exact, recompute_every=1))
    make_checked, _, _ = zoo.FAMILIES[family]()
    monkeypatch.undo()
    plain = models.backend("shard_map", make_plain(), 1)
    checked = models.backend("shard_map", make_checked(), 4)
    a, b = plain.replicate(state), checked.replicate(state)
    for i, batch in enumerate(batches):
        a, _ = plain(a, plain.shard(batch))
        b, metrics = checked(b, checked.shard(batch))
        assert first(metrics["recompute"]) == [i + 1] + [-1] * 6, family
    checked.check_audit()
    ours, theirs = checked.unreplicate(b), plain.unreplicate(a)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        x, y = (jax.random.key_data(v) if jdp._tree.is_prng_key(v) else v for v in (x, y))
        assert np.array_equal(np.asarray(x), np.asarray(y)), family


def test_the_split_optimizer_state_and_a_wrapper_that_drops_the_metric(backend):
    strategy = jdp.strategies.exact(G, shard_optimizer_state=True, recompute_every=1)
    split = models.backend(backend, jdp.make_train_step(models.mlp_loss, strategy=strategy), 4)
    plain = checked(backend, 1, faults=False)
    state, metrics = run(split, split.replicate(initial_state()), DATA[:3])
    reference, _ = run(plain, plain.replicate(initial_state()), DATA[:3])
    assert [m[1] for m in metrics] == [-1, -1, -1]
    for x, y in zip(
        jax.tree.leaves(split.unreplicate(state)),
        jax.tree.leaves(plain.unreplicate(reference)),
        strict=True,
    ):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    base = per_replica(faults=False)

    @jdp.wraps(base)
    def dropping(state, batch):
        state, metrics = base(state, batch)
        return state, {"loss": metrics["loss"]}

    step = models.backend(backend, dropping, 8)
    with pytest.raises(ValueError, match=r"metrics hold no 'recompute' entry: a wrapper"):
        step(step.replicate(initial_state()), step.shard(DATA[0]))

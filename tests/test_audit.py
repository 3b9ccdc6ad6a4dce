"""jdp.Audit: replicas that disagree are caught on device and named; clean runs never alarm."""

import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp import _layout
from tests import models

BATCH = 32
DATA = [models.regression_batch(BATCH, seed=700 + i) for i in range(8)]
STRATEGIES = {
    "data_parallel": jdp.strategies.data_parallel,
    "zero1": jdp.strategies.zero1,
    "fsdp": jdp.strategies.fsdp,
    "exact": lambda: jdp.strategies.exact(8),
}


def initial_state():
    return jdp.TrainState.create(params=models.mlp_params(hidden=13), tx=optax.adam(1e-2))


def audited(backend, strategy=None, every=1, on_mismatch="raise", n=8, faults=False):
    step = jdp.make_train_step(
        models.mlp_loss,
        strategy=strategy or jdp.strategies.exact(8),
        audit=jdp.Audit(every=every, on_mismatch=on_mismatch),
    )
    return models.backend(backend, jdp.testing.with_faults(step) if faults else step, n)


def leaf_names(state):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_clean_steps_agree_and_the_audit_changes_nothing(backend, strategy):
    plain = models.backend(
        backend, jdp.make_train_step(models.mlp_loss, strategy=STRATEGIES[strategy]()), 8
    )
    step = audited(backend, STRATEGIES[strategy]())
    state, reference = step.replicate(initial_state()), plain.replicate(initial_state())
    for i, batch in enumerate(DATA[:3]):
        state, metrics = step(state, step.shard(batch))
        reference, _ = plain(reference, plain.shard(batch))
        assert np.asarray(metrics["audit"]).tolist() == [[i + 1, -1, -1, 8]] * 8
    step.check_audit()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_host_chooses_the_audited_steps_and_the_others_run_none_of_it(backend):
    """every=4 from a state at step 6 (the first call reads its count from the device): steps 8
    and 12 are audited; the other steps' compilation holds no part of the audit; under an outer
    jax.jit, where the host cannot know the count, the graph decides, with the same rows."""
    step = audited(backend, jdp.strategies.data_parallel(), every=4)
    plain = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    start = initial_state().replace(step=jnp.asarray(6, jnp.int32))

    def run(call, runner):
        state, rows = runner.replicate(start), []
        for batch in DATA[:6]:
            state, metrics = call(state, runner.shard(batch))
            rows.append(np.asarray(metrics["audit"])[0].tolist() if "audit" in metrics else None)
        return state, rows

    state, rows = run(step, step)
    skipped = lambda k: [k, -2, -2, 0]  # noqa: E731
    assert rows == [skipped(7), [8, -1, -1, 8], *map(skipped, (9, 10, 11)), [12, -1, -1, 8]]
    twins = step._twins  # by the checks each runs
    assert sorted(map(sorted, twins)) == [[], ["audit"]]
    batch = step.shard(DATA[0])
    assert "all_gather" not in twins[frozenset()].lower(state, batch).as_text()
    assert "all_gather" in twins[frozenset({"audit"})].lower(state, batch).as_text()
    traced, traced_rows = run(jax.jit(lambda s, b: step(s, b)), step)
    reference, _ = run(plain, plain)
    assert traced_rows == rows
    for a, b, c in zip(*map(jax.tree.leaves, (state, traced, reference)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(c)) and np.array_equal(
            np.asarray(b), np.asarray(c)
        )


def candidate_leaves(state):
    """The leaves a replica holds whole and a fault can hit (numeric, not split)."""
    split = _layout.per_replica_leaves(state)
    return [
        i
        for i, (x, s) in enumerate(zip(jax.tree.leaves(state), split, strict=True))
        if not s and np.asarray(x).dtype != bool
    ]


def test_a_hundred_random_faults_are_caught_the_step_they_happen_and_named(backend):
    step = audited(backend, faults=True)
    state0 = initial_state()
    names, leaves = leaf_names(state0), candidate_leaves(state0)
    sizes = [np.size(x) for x in jax.tree.leaves(state0)]
    devices = models.devices(8)
    rng = np.random.default_rng(0)
    for trial in range(100):
        at, replica = int(rng.integers(1, 4)), int(rng.integers(8))
        leaf = int(rng.choice(leaves))
        fault = jdp.testing.Fault(
            at, replica, leaf, int(rng.integers(sizes[leaf])), int(rng.integers(32))
        )
        state = step.replicate(state0)
        with pytest.raises(jdp.ReplicaMismatchError) as caught:
            for i in range(at):
                rows = fault.rows(BATCH) if i + 1 == at else jdp.testing.no_fault(BATCH)
                state, _ = step(state, step.shard((DATA[i], rows)))
            step.check_audit()
        message = str(caught.value)
        device = devices[replica]
        assert message.startswith(
            f"jdp.Audit: replicas disagree after step {at}: replica {replica} "
        ), trial
        assert f"(device {device}, process {device.process_index})" in message
        assert f"7 of the 8 replicas hold, first at leaf state{names[leaf]}." in message


def test_a_fault_between_audits_is_caught_at_the_next_audit(backend):
    every = 4
    step = audited(backend, every=every, on_mismatch="warn", faults=True)
    state0 = initial_state()
    leaves = [i for i in candidate_leaves(state0) if np.size(jax.tree.leaves(state0)[i]) > 1]
    rng = np.random.default_rng(1)
    for trial in range(12):
        at = int(rng.integers(1, 2 * every + 1))
        fault = jdp.testing.Fault(at, int(rng.integers(8)), int(rng.choice(leaves)), 0, 27)
        state, found = step.replicate(state0), None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read from the metrics instead
            for i in range(2 * every):
                rows = fault.rows(BATCH) if i + 1 == at else jdp.testing.no_fault(BATCH)
                state, metrics = step(state, step.shard((DATA[i], rows)))
                first = np.asarray(metrics["audit"])[0].tolist()
                if first[1] >= 0 and found is None:
                    found = first
            step.check_audit()
        due = -(-at // every) * every
        assert found is not None and found[0] == due and found[1] == fault.replica, (trial, found)


def test_warn_reports_and_training_goes_on(backend):
    step = audited(backend, on_mismatch="warn", faults=True)
    state = step.replicate(initial_state())
    fault = jdp.testing.Fault(step=2, replica=3, leaf=1, index=4, bit=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            rows = fault.rows(BATCH) if i == 1 else jdp.testing.no_fault(BATCH)
            state, metrics = step(state, step.shard((DATA[i], rows)))
        step.check_audit()
    # Steps 2, 3 and 4 disagree; the warning comes once, naming the first.
    assert [str(w.message)[:54] for w in caught] == [
        "jdp.Audit: replicas disagree after step 2: replica 3 ("
    ]
    assert caught[0].category is RuntimeWarning
    assert np.asarray(metrics["audit"])[0].tolist() == [4, 3, 1, 7]
    assert int(jdp.unreplicate(state).step) == 4


def test_fit_never_saves_a_state_whose_replicas_disagree(backend, tmp_path):
    step = audited(backend, faults=True)
    fault = jdp.testing.Fault(step=3, replica=6, leaf=1, index=0, bit=25)
    data = [
        (DATA[i], fault.rows(BATCH) if i == 2 else jdp.testing.no_fault(BATCH)) for i in range(5)
    ]
    ckpt = jdp.Checkpointer(tmp_path / "ckpt")
    with pytest.raises(jdp.ReplicaMismatchError, match="after step 3: replica 6"):
        jdp.fit(
            step,
            step.replicate(initial_state()),
            data,
            num_steps=5,
            checkpointer=ckpt,
            checkpoint_every=1,
            progress=False,
        )
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 2


def test_stop_ends_the_process_naming_the_replica(tmp_path):
    script = textwrap.dedent(
        """
        import jdp
        jdp.force_cpu_devices(8)
        import optax
        from tests import models
        step = jdp.shard_map(jdp.testing.with_faults(jdp.make_train_step(
            models.mlp_loss, audit=jdp.Audit(on_mismatch="stop"))))
        state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
        fault = jdp.testing.Fault(step=1, replica=2, leaf=1, index=0, bit=3)
        batch = models.regression_batch(16)
        state, _ = step(state, step.shard((batch, fault.rows(16))))
        step.check_audit()
        print("not reached")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "not reached" not in out.stdout
    assert re.search(
        r"\[jdp\] jdp.Audit: replicas disagree after step 1: replica 2 \(device", out.stderr
    )


def test_a_two_replica_mismatch_says_no_majority(backend):
    step = audited(backend, n=2, faults=True)
    state = step.replicate(initial_state())
    fault = jdp.testing.Fault(step=1, replica=1, leaf=1, index=0, bit=30)
    state, _ = step(state, step.shard((DATA[0], fault.rows(BATCH))))
    with pytest.raises(jdp.ReplicaMismatchError, match="no value is held by a majority of the 2"):
        step.check_audit()


def test_audit_arguments_are_checked():
    with pytest.raises(ValueError, match=r"jdp.Audit: every must be an int >= 1, got 0"):
        jdp.Audit(every=0)
    with pytest.raises(TypeError, match=r"jdp.Audit: every must be an int >= 1, got 2.5"):
        jdp.Audit(every=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"on_mismatch must be one of \('raise', 'warn', 'stop'\)"):
        jdp.Audit(on_mismatch="fail")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"audit must be a jdp.Audit, e.g. audit=jdp.Audit"):
        jdp.make_train_step(models.mlp_loss, audit=10)  # type: ignore[arg-type]


def test_fault_injector_arguments_are_checked(backend):
    with pytest.raises(ValueError, match=r"jdp.testing.Fault: replica must be an int >= 0, got -1"):
        jdp.testing.Fault(step=1, replica=-1, leaf=0)
    with pytest.raises(TypeError, match=r"jdp.testing.Fault: step must be an int >= 0, got '3'"):
        jdp.testing.Fault(step="3", replica=0, leaf=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"index=2147483648 does not fit the int32 rows"):
        jdp.testing.Fault(step=1, replica=0, leaf=0, index=2**31)
    with pytest.raises(ValueError, match=r"Fault.rows: batch_size must be an int >= 1, got 0"):
        jdp.testing.Fault(step=1, replica=0, leaf=0).rows(0)
    step = audited(backend, faults=True)
    state = step.replicate(initial_state())
    pair = r"a faulty step's batch is a pair \(batch, fault rows\); pass step.shard"
    with pytest.raises(TypeError, match=pair + r".*Got a dict\."):
        step(state, step.shard(DATA[0]))
    with pytest.raises(TypeError, match=pair + r".*Got an array of shape \(4, 6\) on one replica"):
        step(state, step.shard(DATA[0]["x"]))
    wrong_rows = np.zeros((BATCH, 5), np.int32)
    with pytest.raises(TypeError, match=r"must be the fault's int32 rows of 6 \(B, 6\).*\(4, 5\)"):
        step(state, step.shard((DATA[0], wrong_rows)))
    # The refused calls consumed nothing: the state still trains.
    state, _ = step(state, step.shard((DATA[0], jdp.testing.no_fault(BATCH))))
    step.check_audit()


def test_a_wrapper_that_drops_the_audit_is_named(backend):
    base = jdp.make_train_step(models.mlp_loss, audit=jdp.Audit())

    @jdp.wraps(base)
    def dropping(state, batch):
        state, metrics = base(state, batch)
        return state, {"loss": metrics["loss"]}

    step = models.backend(backend, dropping, 8)
    state = step.replicate(initial_state())
    with pytest.raises(ValueError, match=r"metrics hold no 'audit' entry: a wrapper \(jdp.wraps\)"):
        step(state, step.shard(DATA[0]))


@pytest.mark.parametrize("strategy", ["data_parallel", "exact"])
def test_no_false_alarm_in_clean_steps(backend, strategy):
    step = audited(backend, STRATEGIES[strategy]())
    state = step.replicate(initial_state())
    batches = [step.shard(b) for b in DATA]
    bad = 0
    for i in range(400):
        state, metrics = step(state, batches[i % len(batches)])
        bad += int(np.asarray(metrics["audit"])[0][1] != -1)
    step.check_audit()
    assert bad == 0


def test_faults_across_two_processes_are_caught_and_named(tmp_path):
    out = tmp_path / "found.npz"
    models.launch("multiprocess_audit.py", 2, 2, out, "faults")
    found = np.load(out)["found"]
    processes = np.load(out)["processes"].tolist()
    assert len(found) == 20 and sorted(set(processes)) == [0, 1]
    for at, replica, leaf, _, _, step, named, first_leaf, votes in found.tolist():
        assert (step, named, first_leaf, votes) == (at, replica, leaf, 3)
    assert {processes[r] for r in found[:, 1]} == {0, 1}  # faults on both processes


def test_stop_across_two_processes_ends_the_job(tmp_path):
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", "2", "--devices-per-process", "2"]
    cmd += [str(root / "tests" / "scripts" / "multiprocess_audit.py"), str(tmp_path / "x"), "stop"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    assert "not reached" not in run.stdout
    assert "jdp.Audit: replicas disagree after step 2: replica 3 (device" in run.stderr
    assert "process 1) differs from the value 3 of the 4 replicas hold" in run.stderr

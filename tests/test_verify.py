"""Run certificates: checkpoints record the state's fingerprints, and jdp.verify names where two runs part."""

import jax
import numpy as np
import optax
import pytest

import jdp
import jdp.verify
from jdp.testing import Fault, with_faults
from tests import zoo

STEPS, FAULT_STEP = 40, 37


def lm_step(faults=False):
    step = jdp.make_train_step(
        zoo.lm_loss,
        has_rng=True,
        strategy=jdp.strategies.exact(8),
        metrics=[jdp.metrics.fingerprint(), jdp.metrics.leaf_fingerprints()],
    )
    return with_faults(step) if faults else step


def train(folder, n, fault=None):
    """The zoo transformer, exact mode, on n devices; a checkpoint every 10 steps."""
    _, state, _ = zoo.transformer()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",))
    step = jdp.shard_map(lm_step(faults=fault is not None), mesh=mesh)
    data = zoo.lm_batches(STEPS)
    if fault is not None:
        data = [(batch, fault.rows(len(batch["tokens"]))) for batch in data]
    with jdp.Checkpointer(folder) as ckpt:
        _, history = jdp.fit(
            step,
            step.replicate(state),
            data,
            num_steps=STEPS,
            checkpointer=ckpt,
            checkpoint_every=10,
            log_every=1,
            progress=False,
        )
    return state, history


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    state, one = train(root / "one", 1)
    _, eight = train(root / "eight", 8)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    leaf = next(i for i, p in enumerate(paths) if p.endswith("['kernel']"))
    fault = Fault(step=FAULT_STEP, replica=0, leaf=leaf, index=7, bit=12)
    _, faulty = train(root / "faulty", 8, fault)
    return root, (one, eight, faulty), paths[leaf]


def test_a_checkpoint_records_the_fingerprints_the_step_reported(runs):
    root, (_, eight, _), _ = runs
    row = next(r for r in eight.train if r["step"] == STEPS)
    with jdp.Checkpointer(root / "eight") as ckpt:
        recorded = ckpt.fingerprints(STEPS)
    assert recorded["state"] == row["fingerprint"]
    assert list(recorded["leaves"].values()) == row["leaf_fingerprints"]
    # The per-leaf rows sum (mod 2**32) to the state's fingerprint.
    total = np.asarray(row["leaf_fingerprints"], np.uint32).sum(axis=0, dtype=np.uint32)
    assert total.tolist() == row["fingerprint"]


def test_exact_runs_on_1_and_8_devices_are_certified_identical(runs, capsys):
    root, (one, eight, _), _ = runs
    assert jdp.verify.compare_histories(one, eight) is None
    assert [r["fingerprint"] for r in one.train] == [r["fingerprint"] for r in eight.train]
    report = jdp.verify.compare_checkpoints(root / "one", root / "eight")
    assert report.identical and report.history_compared and report.checkpoints == [20, 30, 40]
    assert report.replay_from is None
    assert jdp.verify.main([str(root / "one"), str(root / "eight")]) == 0
    assert "agree wherever both recorded a fingerprint" in capsys.readouterr().out


def test_verify_names_the_step_and_the_leaf_a_fault_hit(runs, capsys):
    root, (one, _, faulty), leaf = runs
    found = jdp.verify.compare_histories(one, faulty, leaf_names=None)
    assert (found.step, found.agreed) == (FAULT_STEP, FAULT_STEP - 1)
    assert len(found.leaves) == 1 and found.leaves[0].startswith("leaf ")
    report = jdp.verify.compare_checkpoints(root / "one", root / "faulty")
    assert report.history.step == FAULT_STEP and report.history.leaves == (leaf,)
    assert report.checkpoint.step == STEPS and report.checkpoints == [20, 30, 40]
    assert report.checkpoint.agreed == 2 and leaf in report.checkpoint.leaves
    assert jdp.verify.main([str(root / "one"), str(root / "faulty")]) == 1
    out = capsys.readouterr().out
    assert f"first differ at step {FAULT_STEP} (a logged step; the 36 compared before agree)" in out
    assert f"leaves that differ there (1): {leaf}" in out
    assert report.replay_from == 30
    assert "jdp.verify.replay the steps after checkpoint 30, the newest both agree on" in out


def test_verify_refuses_what_it_cannot_compare(tmp_path, capsys):
    assert jdp.verify.main([str(tmp_path / "missing"), str(tmp_path)]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert jdp.verify.main([str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    with pytest.raises(ValueError, match="share no step with a logged fingerprint"):
        jdp.verify.compare_histories(jdp.History(), jdp.History())
    with pytest.raises(TypeError, match=r"compare_histories: b must be a jdp.History .*got list"):
        jdp.verify.compare_histories(jdp.History(), [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"leaf_names must be a sequence of names.*'params'"):
        jdp.verify.compare_histories(jdp.History(), jdp.History(), leaf_names="params")
    state = jdp.TrainState.create(params=np.ones(3, np.float32), tx=optax.sgd(0.1))
    for run in ("a", "b"):
        with jdp.Checkpointer(tmp_path / run) as ckpt:
            ckpt.save(1, state)
    # No history, but the checkpoints' fingerprints compare.
    assert jdp.verify.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0


def test_replay_from_the_last_agreed_checkpoint_names_the_phase_and_the_leaf(runs):
    root, _, leaf = runs
    _, template, _ = zoo.transformer()
    with jdp.Checkpointer(root / "one") as ckpt:  # step 30: the last checkpoint both agree on
        state, _ = ckpt.restore(template, 30, place=lambda tree: tree)
    batches = zoo.lm_batches(STEPS)[30:FAULT_STEP]
    one, eight = jdp.pmap(lm_step(), devices=jax.devices()[:1]), jdp.shard_map(lm_step())
    # Replayed alike (on 1 device under pmap, 8 under shard_map), the runs agree:
    # the fault did not recur (it was transient).
    assert jdp.verify.replay(one, eight, state, batches) is None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    fault = Fault(step=FAULT_STEP, replica=3, leaf=paths.index(leaf), index=7, bit=12)
    rows = [(b, fault.rows(len(b["tokens"]))) for b in batches]
    faulty = jdp.shard_map(lm_step(faults=True))
    found = jdp.verify.replay(one, faulty, state, batches, batches_b=rows)
    assert found == jdp.verify.PhaseDifference(FAULT_STEP, "after the update", (leaf,), (("b", 3),))
    # The same bit flipped in one virtual replica's gradients, computed on device 3.
    params = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]
    ]
    param = leaf.removeprefix(".params")
    fault = Fault(FAULT_STEP, 3, params.index(param), 7, 12, virtual_replica=3)
    rows = [(b, fault.rows(len(b["tokens"]))) for b in batches]
    faulty = jdp.shard_map(with_faults(lm_step(), "gradients"))
    found = jdp.verify.replay(one, faulty, state, batches, batches_b=rows)
    assert found == jdp.verify.PhaseDifference(
        FAULT_STEP, "forward/backward", ("['grads']" + param,), ()
    )

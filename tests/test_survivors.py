"""The survivors' copy (Checkpointer(local_directory=...)): a process that dies costs no
completed step. In one process the exit path's hook is called by hand; the jobs kill a
process of a 4 x 2 exact-mode job (a random one, fixed seed; process 0 too) and of 2 x 2
jobs under each strategy, restarted by jdp.launch, and rerun a job mpirun or srun ended."""

import itertools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from jdp import _standby, _standby_restore
from jdp.launch import _left, free_port
from tests import models
from tests.launching import MPIRUN, MPIRUN_ENV, SRUN, mpirun_command
from tests.test_restarts import (
    SCRIPT,
    STEPS,
    assert_bitwise,
    assert_same_samples_and_close,
    env,
    launched,
    run,
)

DATA = models.regression_batch(96, seed=5)


def fit(
    directory,
    num_steps,
    callbacks=(),
    donate=False,
    local=True,
    strategy=None,
    backend="pmap",
    local_directory=None,
    audit=None,
    time_every=0,
):
    train_step = jdp.make_train_step(models.mlp_loss, strategy=strategy, audit=audit)
    step = models.backend(backend, train_step, 8, donate_state=None if donate else False)
    state = jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2))
    if local_directory is None and local:
        local_directory = directory / "local"
    with jdp.Checkpointer(directory / "ckpt", local_directory=local_directory) as ckpt:
        return jdp.fit(
            step,
            step.replicate(state),
            jdp.BatchIterator(DATA, 16, seed=2),
            num_steps=num_steps,
            checkpointer=ckpt,
            checkpoint_every=5,
            callbacks=callbacks,
            log_every=1,
            progress=False,
            time_every=time_every,
        )


def fail_at(step):
    """A callback that, at ``step``, runs the exit path's hook and raises (a process failing)."""

    def callback(row):
        if row["step"] == step:
            _standby.write_active(60.0)  # as the exception hook calls it
            raise RuntimeError(f"failed at step {step}")

    return callback


def leaves(state):
    return [
        np.asarray(x) for x in jax.tree.leaves(jdp.unreplicate((state.params, state.opt_state)))
    ]


def test_a_failed_fit_resumes_from_the_kept_step_not_the_checkpoint(tmp_path):
    reference, _ = fit(tmp_path / "reference", 20)
    with pytest.raises(RuntimeError, match="failed at step 8"):
        fit(tmp_path, 20, callbacks=[fail_at(8)])
    # The row of step 8 is read after step 9 is dispatched: step 8 is the newest the
    # loop held when it failed, kept instead of checkpoint 5.
    assert _standby_restore.newest(next((tmp_path / "local").iterdir())) == 8
    state, history = fit(tmp_path, 20)
    assert history.resumed_at == [8]
    assert [row["step"] for row in history.train] == list(range(1, 21))
    for got, expected in zip(leaves(state), leaves(reference), strict=True):
        np.testing.assert_array_equal(got, expected)
    assert not list((tmp_path / "local").rglob("*.npz"))  # a finished run removes its copies


def test_timed_and_audited_steps_keep_the_copy_and_resume_to_the_same_bits(tmp_path):
    """Under jdp.shard_map fit writes each new state into a spare (call_into), also from the
    timed twin (every 3 steps) and the audit's twins (every 4): a failure at step 8 resumes
    from the kept step to the bits of the plain run."""
    exact = jdp.strategies.exact(8)
    reference, _ = fit(tmp_path / "reference", 13, strategy=exact, backend="shard_map")
    checked = dict(strategy=exact, backend="shard_map", audit=jdp.Audit(every=4), time_every=3)
    with pytest.raises(RuntimeError, match="failed at step 8"):
        fit(tmp_path, 13, callbacks=[fail_at(8)], **checked)
    assert _standby_restore.newest(next((tmp_path / "local").iterdir())) == 8
    state, history = fit(tmp_path, 13, **checked)
    assert history.resumed_at == [8]
    audits = {row["step"]: list(row["audit"]) for row in history.train}
    assert audits == {k: [k, -1, -1, 8] if k % 4 == 0 else [k, -2, -2, 0] for k in range(1, 14)}
    rows = history.train[8:]  # the resumed run's
    # A row takes the stamps of the timed steps finished by then: step 9's may already be in
    # the resumed run's first sample, which opens no window; step 12's are in row 12's or 13's.
    assert any("compute_ms/0" in row.get("pace", {}) for row in rows)
    # The ledger books each twin's first call as compilation: the timed twin at step 9, the
    # ordinary step (between audits) at 10, the timed twin's audited twin at 12.
    grew = [
        b["step"]
        for a, b in zip(history.train[7:-1], rows, strict=True)
        if b["time"]["compile"] > a["time"]["compile"]
    ]
    assert grew == [9, 10, 12], [(r["step"], r["time"]) for r in rows]
    for got, expected in zip(leaves(state), leaves(reference), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_copy_older_than_the_checkpoint_is_not_used(tmp_path):
    with pytest.raises(RuntimeError):
        fit(tmp_path, 20, callbacks=[fail_at(3)])  # step 4 kept, no checkpoint yet
    _, history = fit(tmp_path, 12, local=False)  # trains from 0 to checkpoint 12
    assert history.resumed_at == []
    _, history = fit(tmp_path, 14)
    assert history.resumed_at == [12]


def test_the_checkpoint_folder_itself_can_hold_the_copies(tmp_path):
    with pytest.raises(RuntimeError):
        fit(tmp_path, 12, callbacks=[fail_at(7)], local_directory=tmp_path / "ckpt")
    _, history = fit(tmp_path, 12, local_directory=tmp_path / "ckpt")
    assert history.resumed_at == [7]
    with jdp.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.all_steps() == [5, 10, 12]  # the copies' folder is not a step


def test_copies_of_another_run_in_the_same_folder_are_ignored(tmp_path):
    with pytest.raises(RuntimeError):
        fit(tmp_path, 20, callbacks=[fail_at(8)])
    stale = next((tmp_path / "local").iterdir())
    shutil.rmtree(tmp_path / "ckpt")  # the user starts over in the same folder
    _, history = fit(tmp_path, 6)
    assert history.resumed_at == []
    assert not stale.exists()


def test_a_step_that_donates_its_state_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"donate_state=False") as info:
        fit(tmp_path, 4, donate=True)
    assert str(info.value).startswith("jdp.fit: Checkpointer(local_directory=...) keeps")


def test_the_exit_path_waits_for_a_running_step_only_as_long_as_its_grace(tmp_path):
    release = threading.Event()

    def held_back(x):
        release.wait(60)
        return x

    # A step on 8 devices runs on their threads: dispatch returns, the state is not ready.
    step = jax.pmap(lambda x: jax.pure_callback(held_back, jax.ShapeDtypeStruct((3,), x.dtype), x))
    standby = _standby.Standby(tmp_path, 0)
    standby.keep(1, {"w": jnp.ones((8, 3))}, None, None)
    standby.keep(2, {"w": step(jnp.ones((8, 3)))}, None, None)
    try:
        start = time.monotonic()
        assert standby.write(0.3) == 1  # a step that never completes: the one before it
        assert 0.3 <= time.monotonic() - start < 10
        threading.Timer(0.2, release.set).start()
        assert standby.write(30.0) == 2  # one that completes within the grace: itself
        assert _standby_restore.newest(tmp_path) == 2
    finally:
        release.set()  # a failed assertion must not leave the devices' threads blocked


SPLIT = {
    "zero1": jdp.strategies.zero1,
    "fsdp": jdp.strategies.fsdp,
    "exact_split": lambda: jdp.strategies.exact(8, shard_optimizer_state=True),
}


@pytest.mark.parametrize("strategy", list(SPLIT))
def test_a_split_state_resumes_from_its_rows(tmp_path, strategy, backend):
    split = SPLIT[strategy]()
    reference, _ = fit(tmp_path / "reference", 12, strategy=split, backend=backend)
    with pytest.raises(RuntimeError, match="failed at step 7"):
        fit(tmp_path, 12, callbacks=[fail_at(7)], strategy=split, backend=backend)
    state, history = fit(tmp_path, 12, strategy=split, backend=backend)
    assert history.resumed_at == [7]
    for got, expected in zip(leaves(state), leaves(reference), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_copy_missing_rows_is_not_used_and_says_so(tmp_path):
    with pytest.raises(RuntimeError):
        fit(tmp_path, 12, callbacks=[fail_at(7)], strategy=jdp.strategies.zero1())
    (path,) = (tmp_path / "local").rglob("7.0.npz")
    with np.load(path) as saved:
        arrays = dict(saved)
    split = next(name for name in arrays if name.startswith("index"))
    rows = "rows" + split.removeprefix("index")
    arrays[split], arrays[rows] = arrays[split][1:], arrays[rows][1:]  # row 0 on no process
    np.savez(path, **arrays)
    with pytest.warns(RuntimeWarning, match=r"survivors' copy of step 7 is not used \(rows of"):
        _, history = fit(tmp_path, 12, strategy=jdp.strategies.zero1())
    assert history.resumed_at == [5]  # the disk checkpoint


def test_a_local_directory_that_is_not_a_path_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"^jdp.Checkpointer: local_directory must be a path"):
        jdp.Checkpointer(tmp_path, local_directory=3)


def test_the_host_copy_reads_keys_and_both_layouts(tmp_path):
    state = {"w": jnp.arange(6.0).reshape(2, 3), "key": jax.random.key(4)}
    for placed in (jdp.replicate(state), jdp.shard_map(lambda s, b: (s, {})).replicate(state)):
        # The copy reads only completed buffers; the placement's transfer is asynchronous.
        host = _standby._host_copy(jax.block_until_ready(placed), [None, None])
        assert host is not None
        arrays, described = host
        np.testing.assert_array_equal(arrays["leaf1"], np.asarray(state["w"]))
        np.testing.assert_array_equal(
            arrays["leaf0"], np.asarray(jax.random.key_data(state["key"]))
        )
        assert described[1] == {"shape": [2, 3], "dtype": "float32"}


# Another thread's output may share the line: the message names its process itself.
KEPT = re.compile(r"\[jdp\] process (\d) kept step (\d+)")


def killed_job(directory, victim, at, **extra):
    """A 4 x 2 exact-mode job whose process ``victim`` SIGKILLs itself at step ``at``."""
    cmd, environ = launched(directory, restarts=1, LOCAL="1", KILL_AT=f"{victim}:{at}", **extra)
    cmd[cmd.index("--processes") + 1] = "4"
    cmd[cmd.index("--devices-per-process") + 1] = "2"
    cmd.insert(cmd.index("--max-restarts"), "--elastic")
    return cmd, environ


def first_position_read_again(log):
    """The first iterator position a restarted process read (its positions went back)."""
    positions = [int(line.split(" ", 1)[0]) for line in pathlib.Path(log).read_text().splitlines()]
    return next(b for a, b in itertools.pairwise(positions) if b <= a)


@pytest.mark.parametrize("victim", ["random", 0])
def test_a_killed_process_costs_no_completed_step_and_no_bit(tmp_path, victim, reference):
    rng = np.random.default_rng(32)  # one schedule per run; benchmarks/survivors.py runs 20
    victim = int(rng.integers(1, 4)) if victim == "random" else victim
    at = int(rng.integers(6, 24))
    result = run(killed_job(tmp_path, victim, at, RECORD=str(tmp_path / "ids")), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on the 2 process(es) left of 4" in result.stderr, result.stderr[-3000:]
    kept = {int(p): int(s) for p, s in KEPT.findall(result.stderr)}
    assert victim not in kept and len(kept) >= 2, result.stderr[-3000:]
    # The victim read its row for step `at`, so `at` was complete everywhere, and
    # every survivor kept the same step: the newest one every process completed.
    (step,) = set(kept.values())
    assert step >= at, (kept, at)
    assert f"[jdp] resuming at step {step} from the survivors' copy" in result.stderr
    assert first_position_read_again(tmp_path / "ids-0") == step + 1  # no batch skipped or redone
    assert_bitwise(tmp_path, reference)


@pytest.mark.parametrize(
    ("strategy", "backend"),
    [("data_parallel", "pmap"), ("zero1", "pmap"), ("fsdp", "pmap"), ("zero1", "shard_map")],
)
def test_the_ordinary_step_continues_from_the_kept_step_with_the_same_samples(
    tmp_path, strategy, backend
):
    """2 x 2, the same layout after the restart: every position is trained on the same
    examples as without the kill, and the state agrees (rtol 1e-6). Under zero1 and fsdp
    the dead process's rows come from the copy the other process held, sent inside
    the step, so the kept step is the same under every strategy."""
    ref_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    record = {"STRATEGY": strategy, "LOCAL": "1", "BACKEND": backend}
    result = run(launched(ref_dir, RECORD=str(ref_dir / "ids"), **record))
    assert result.returncode == 0, result.stderr[-3000:]
    result = run(
        launched(
            killed_dir,
            restarts=1,
            KILL_AT="1:13",
            KILL_SETTLE="1",
            RECORD=str(killed_dir / "ids"),
            **record,
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kept = {int(s) for _, s in KEPT.findall(result.stderr)}
    assert len(kept) == 1, result.stderr[-5000:]
    (step,) = kept
    # Process 1 read step 13's row back after dispatching step 14, waited for it to
    # complete everywhere, then died: step 14 is the newest completed step. (A row copy
    # run after the step, not in it, was never dispatched for step 14: 13 was kept.)
    assert step == 14, step
    assert f"[jdp] resuming at step {step} from the survivors' copy" in result.stderr
    assert_same_samples_and_close(ref_dir, killed_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted exact-mode run: 1 process x 4 devices."""
    directory = tmp_path_factory.mktemp("reference")
    cmd = [os.sys.executable, str(pathlib.Path(__file__).parent / "scripts" / "preempt_run.py")]
    result = subprocess.run(
        [*cmd, str(directory), str(STEPS)],
        env=env(JDP_CPU_DEVICES_PER_PROCESS="4"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(directory / "final.npz")


@pytest.mark.parametrize(
    ("processes", "running", "lost", "left"),
    [(4, 4, 1, 2), (4, 4, 3, 1), (8, 8, 1, 4), (6, 6, 1, 3), (4, 2, 1, 1), (4, 4, 0, 4)],
)
def test_an_elastic_restart_runs_on_the_largest_divisor_left(processes, running, lost, left):
    assert _left(processes, running, lost) == left


@pytest.mark.parametrize("launcher", [MPIRUN, SRUN])
def test_under_mpirun_or_srun_the_rerun_resumes_from_what_the_survivor_kept(
    tmp_path, launcher, reference
):
    """mpirun and srun end the job when a rank dies; the rank left writes its copy on the
    SIGTERM they send, and the job run again resumes from it, bitwise."""
    extra = {"JDP_CPU_DEVICES_PER_PROCESS": "2", "LOCAL": "1", "KILL_AT": "1:13"}

    def run_job():
        args = (SCRIPT, str(tmp_path), str(STEPS))
        if launcher == "srun":
            cmd = ["srun", "-n", "2", "--kill-on-bad-exit=1", "--label", sys.executable, *args]
            environ = env(**extra)
        else:
            names = ["PYTHONPATH", "JAX_COORDINATOR_PORT", *extra]
            cmd = mpirun_command(*args, exported=names)
            environ = env(JAX_COORDINATOR_PORT=str(free_port()), **extra, **MPIRUN_ENV)
        return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=300)

    killed = run_job()
    assert killed.returncode != 0
    kept = {int(s) for _, s in KEPT.findall(killed.stdout + killed.stderr)}
    assert len(kept) == 1 and min(kept) >= 13, (killed.stderr[-3000:], kept)
    (step,) = kept
    again = run_job()
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[jdp] resuming at step {step} from the survivors' copy" in again.stderr
    assert_bitwise(tmp_path, reference)

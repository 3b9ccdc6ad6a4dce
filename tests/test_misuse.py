"""Misuse never crashes, hangs or silently changes a result.

One test per case a new user hit. Where a crash or a hang is
possible, the case runs in a fresh process under a timeout, so the suite
itself can neither crash nor hang.
"""

import ast
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent


def fresh(code: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """Runs ``code`` in a new interpreter on 8 CPU devices."""
    prelude = "import jax, jdp\njdp.force_cpu_devices(8)\n"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def launch(script, *args, processes=2, timeout=120, extra=()):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", str(processes)]
    cmd += [
        "--devices-per-process",
        "2",
        *extra,
        str(ROOT / "tests" / "scripts" / script),
        *map(str, args),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def simple_state():
    return jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))


# --- crashes ---------------------------------------------------------------


def test_reusing_a_consumed_state_is_an_error_not_a_segfault(backend):
    run = fresh(f"""
        import jax.numpy as jnp, numpy as np, optax
        step = jdp.{backend}(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
        state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
        batch = step.shard(np.ones(16, np.float32))
        new, _ = step(state, batch)
        try:
            step(state, batch)  # re-running a notebook cell
        except RuntimeError as e:
            print("ERROR:", e)
        new, _ = step(new, batch)  # the returned state goes on
        print("ok", float(step.unreplicate(new).params))
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ERROR: jdp: this state was consumed by an earlier step call" in run.stdout
    assert "Use the state the step returned" in run.stdout
    assert float(run.stdout.rsplit("ok ", 1)[1]) == pytest.approx(0.64)


def test_re_placing_a_consumed_state_names_it(backend):
    """A notebook cell that re-places the state a step consumed gets jdp's error, not JAX's."""
    run = fresh(f"""
        import jax.numpy as jnp, numpy as np, optax
        step = jdp.{backend}(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
        state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
        new, _ = step(state, step.shard(np.ones(16, np.float32)))
        fit = lambda s: jdp.fit(step, s, [np.ones(16, np.float32)] * 2, num_steps=2)
        for place in (step.replicate, jdp.replicate, jdp.gather_replicas, fit):
            try:
                place(state)
            except RuntimeError as e:
                print("ERROR:", e)
        print("ok", float(step.unreplicate(step.replicate(step.unreplicate(new))).params))
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    name = {"pmap": "PmapStep", "shard_map": "ShardMapStep"}[backend]
    for what in (
        f"jdp.{name}.replicate",
        "jdp.replicate",
        "jdp.gather_replicas",
        "jdp.fit: the state",
    ):
        assert f"ERROR: {what}: leaf .step was consumed by an earlier step call" in run.stdout, (
            run.stdout
        )
    assert float(run.stdout.rsplit("ok ", 1)[1]) == pytest.approx(0.8)


def test_evaluation_never_consumes_the_state(backend):
    run = fresh(f"""
        import jax.numpy as jnp, numpy as np, optax
        train = jdp.{backend}(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
        evaluate = jdp.{backend}(jdp.make_eval_step(lambda p, b: {{"v": b * p}}))
        state = train.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
        metrics = jdp.evaluate(evaluate, state, [np.ones(16, np.float32)])
        state, _ = train(state, train.shard(np.ones(16, np.float32)))
        print("ok", metrics["v"], float(train.unreplicate(state).params))
    """)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ok 1.0 0.8" in run.stdout


def test_an_eval_step_cannot_be_told_to_donate():
    with pytest.raises(ValueError, match="would delete the caller's state"):
        jdp.pmap(jdp.make_eval_step(lambda p, b: {"v": b}), donate_state=True)


# --- hangs -----------------------------------------------------------------


def test_batch_iterator_over_no_examples_ends():
    empty = {"x": np.zeros((0, 3), np.float32)}
    it = jdp.BatchIterator(empty, 8, remainder="pad", repeat=False)
    assert list(it) == []
    with pytest.raises(ValueError, match="0 examples, so a repeating iterator would never"):
        jdp.BatchIterator(empty, 8, remainder="pad")


def test_processes_that_disagree_on_steps_end_the_job_naming_the_stalled_one(tmp_path):
    start = time.monotonic()
    # 20 s: heartbeats on a loaded 2-core machine can lag by several seconds.
    run = launch("multiprocess_stall.py", tmp_path / "pid", extra=("--timeout", "20"), timeout=200)
    assert run.returncode != 0
    # Named from inside the job (each process's watchdog), or by the launcher.
    inside = "process 0 of 2" in run.stderr and "process 1: finished after" in run.stderr
    launcher = "[launch] process(es) [0] stopped making progress" in run.stderr
    assert inside or launcher, run.stderr[-3000:]
    assert time.monotonic() - start < 150
    assert "[Gloo] Rank" not in run.stdout + run.stderr  # quiet unless --verbose


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_no_process_survives_the_launcher(tmp_path, how):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", "2", "--devices-per-process", "2"]
    cmd += [
        "--timeout",
        "300",
        str(ROOT / "tests" / "scripts" / "multiprocess_stall.py"),
        str(tmp_path / "pid"),
    ]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        pids = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(p.read_text()) for p in tmp_path.glob("pid-*") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, "the processes did not start"
        launcher.send_signal(how)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids)
    finally:
        launcher.kill()


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


# --- silent misuse: now an error or a warning --------------------------------


def test_shard_map_step_fed_a_host_batch_in_the_pmap_layout_warns():
    """Reshaped by hand on the host, (8, 4, ...) could be 8 examples: only a warning can tell.

    (jdp.shard's placed batch is told apart by its mesh and trained right: tests/test_layouts.py.)
    """
    step = jdp.shard_map(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(simple_state())
    host = {k: v.reshape((8, 4) + v.shape[1:]) for k, v in models.regression_batch(32).items()}
    with pytest.warns(UserWarning, match=r"pmap-layout batch .* use step.shard\(batch\)"):
        step(state, host)


def test_unreplicate_of_a_never_replicated_tree_is_an_error():
    with pytest.raises(
        ValueError, match=r"leaf \['b1'\] \(shape \(16,\)\) lives on a single device"
    ):
        jdp.unreplicate(simple_state().params)


def test_broadcast_from_a_replica_that_does_not_exist():
    f = jax.pmap(lambda x: jdp.broadcast(x, "batch", 8), axis_name="batch")
    with pytest.raises(ValueError, match=r"source=8 but axis 'batch' has 8 replicas"):
        f(jnp.arange(8.0))


def test_min_loss_scale_above_the_loss_scale():
    with pytest.raises(ValueError, match="min_loss_scale=8.0 is above the initial loss_scale=4.0"):
        jdp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=8.0)


def test_checkpoint_steps_must_be_non_negative_ints(tmp_path):
    ckpt = jdp.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        ckpt.save(-1, simple_state())
    with pytest.raises(TypeError, match="step must be an int >= 0, got 1.5"):
        ckpt.save(1.5, simple_state())


def test_fit_refuses_options_that_would_do_nothing():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(simple_state())
    data = jdp.BatchIterator(models.regression_batch(64), 32)
    with pytest.raises(ValueError, match="checkpoint_every was given without a checkpointer"):
        jdp.fit(step, state, data, num_steps=1, checkpoint_every=1, progress=False)
    with pytest.raises(ValueError, match="eval_data was given without eval_step"):
        jdp.fit(step, state, data, num_steps=1, eval_data=lambda: [], progress=False)
    with pytest.raises(ValueError, match="eval_step was given without eval_data"):
        eval_step = jdp.pmap(jdp.make_eval_step(lambda p, b: {"v": b["y"][:, 0]}))
        jdp.fit(step, state, data, num_steps=1, eval_step=eval_step, progress=False)


def test_forgetting_initialize_under_the_launcher_stops_the_data_too(monkeypatch):
    from jdp import distributed

    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(RuntimeError, match="was not called"):
        jdp.BatchIterator(models.regression_batch(64), 32)


def test_set_state_of_other_data_of_the_same_size_is_refused():
    a = jdp.BatchIterator(models.regression_batch(64, seed=1), 16)
    b = jdp.BatchIterator(models.regression_batch(64, seed=2), 16)
    next(a)
    with pytest.raises(ValueError, match="saved fingerprint=.* but this iterator has"):
        b.set_state(a.get_state())


# --- confusing errors: now jdp's own message ----------------------------------


def test_evaluate_given_a_training_step():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(simple_state())
    with pytest.raises(TypeError, match="would train on the evaluation data"):
        jdp.evaluate(step, state, [models.regression_batch(16)])
    jdp.assert_replicas_in_sync(state)  # nothing ran


def test_fit_given_an_eval_step_to_train():
    eval_step = jdp.pmap(jdp.make_eval_step(lambda p, b: {"v": b["y"][:, 0]}))
    state = eval_step.replicate(simple_state())
    with pytest.raises(TypeError, match="train_step is an evaluation step"):
        jdp.fit(eval_step, state, [models.regression_batch(16)], num_steps=1, progress=False)


def test_fit_over_a_plain_generator_trains():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(simple_state())
    batches = (models.regression_batch(32, seed=i) for i in range(3))
    state, history = jdp.fit(step, state, batches, num_steps=3, log_every=1, progress=False)
    assert [row["step"] for row in history.train] == [1, 2, 3]
    with pytest.raises(ValueError, match="train_data ran out after step 3 of 5"):
        jdp.fit(step, state, iter([]), num_steps=5, progress=False)


def test_fit_resuming_a_checkpoint_saved_by_hand(tmp_path):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(simple_state())
    with jdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state)
        with pytest.raises(ValueError, match="was not written by fit"):
            jdp.fit(step, state, [], num_steps=1, checkpointer=ckpt, progress=False)


def test_epoch_hook_returning_something_else():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    state = step.replicate(simple_state())
    data = jdp.BatchIterator(models.regression_batch(32), 32)
    with pytest.raises(TypeError, match="on_epoch_end returned a int"):
        jdp.fit(step, state, data, num_steps=2, on_epoch_end=lambda e, s: 1, progress=False)


def test_set_state_with_missing_keys():
    it = jdp.BatchIterator(models.regression_batch(64), 16)
    with pytest.raises(ValueError, match=r"lacks \['batch_size', 'fingerprint'"):
        it.set_state({"epoch": 0, "position": 0, "iteration": 0, "seed": 0, "size": 64})


def test_replicating_twice():
    state = jdp.replicate(simple_state())
    with pytest.raises(ValueError, match=r"already on 8 devices .* replicated already"):
        jdp.replicate(state)


def test_python_float_loss():
    step = jdp.pmap(jdp.make_train_step(lambda p, b: 1.0))
    with pytest.raises(
        TypeError, match=r"returned a Python float \(1.0\).*a constant has no gradient"
    ):
        step(step.replicate(simple_state()), step.shard(models.regression_batch(16)))


def test_wrong_axis_name_in_a_custom_step(backend):
    def custom(state, batch):
        grads = jax.lax.pmean(jax.grad(models.mlp_loss)(state.params, batch), "devices")
        return jdp.apply_gradients(state, grads)

    step = models.backend(backend, custom, 8)
    with pytest.raises(NameError, match=f"jdp.{backend} does not bind.*axis_name='batch'"):
        step(step.replicate(simple_state()), step.shard(models.regression_batch(16)))


def test_integer_leaf_in_params():
    params = {**models.mlp_params(), "count": jnp.zeros((), jnp.int32)}
    state = jdp.TrainState.create(params=params, tx=optax.sgd(0.1))
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    with pytest.raises(TypeError, match=r"parameter \['count'\] has dtype int32"):
        step(step.replicate(state), step.shard(models.regression_batch(16)))


def test_model_state_requested_but_absent():
    step = jdp.pmap(jdp.make_train_step(models.classifier_eval_mode_loss, has_model_state=True))
    with pytest.raises(ValueError, match=r"has_model_state=True\) needs model state"):
        step(step.replicate(simple_state()), step.shard(models.classification_batch(16)))


def test_checkpointer_on_a_file(tmp_path):
    target = tmp_path / "model.ckpt"
    target.write_text("")
    with pytest.raises(ValueError, match="model.ckpt is a file; pass a directory"):
        jdp.Checkpointer(target)


@pytest.mark.parametrize("flag", ["--steps", "--batch-size"])
def test_demo_flags_of_zero(flag):
    run = subprocess.run(
        [sys.executable, "-m", "jdp.demo", flag, "0"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "must be >= 1, got 0" in run.stderr
    assert "Traceback" not in run.stderr


def test_demo_bfloat16_communication_under_the_exact_default_says_how():
    cmd = [sys.executable, "-m", "jdp.demo", "--communication", "bfloat16"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "exact mode (on by default with float32)" in run.stderr
    assert "--no-exact, or --precision bfloat16" in run.stderr


# --- cluster correctness --------------------------------------------------------


def test_processes_restore_the_same_step(tmp_path):
    run = launch("multiprocess_restore.py", tmp_path / "ckpt", timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("restored 1") == 2, run.stdout
    assert "Skipped damaged checkpoint(s) step 2 (RuntimeError: failed on another process)" in (
        run.stderr
    )
    assert "step 2 (OSError: injected read error on process 1)" in run.stderr


def test_fallback_only_for_read_errors(tmp_path, monkeypatch):
    ckpt = jdp.Checkpointer(tmp_path)
    ckpt.save(1, simple_state())
    ckpt.save(2, simple_state())

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not damage")

    monkeypatch.setattr(ckpt._manager, "restore", broken)
    with pytest.raises(RuntimeError, match="a bug, not damage"):
        ckpt.restore(simple_state())


def test_async_checkpoint_survives_an_uncaught_exception_under_launch(tmp_path):
    run = launch("multiprocess_crash_save.py", tmp_path / "ckpt", processes=1, timeout=180)
    assert run.returncode == 1 and "boom right after an async save" in run.stderr
    state = jdp.TrainState.create(params=jnp.zeros((512, 512)), tx=optax.adam(0.1))
    restored, _ = jdp.Checkpointer(tmp_path / "ckpt").restore(state)
    assert float(jdp.unreplicate(restored).params[3, 4]) == 1.0


# --- noise ---------------------------------------------------------------------


def test_a_damaged_checkpoint_costs_one_warning(tmp_path):
    run = fresh(f"""
        import pathlib, warnings, jax.numpy as jnp, optax
        state = jdp.replicate(jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1)))
        with jdp.Checkpointer({str(tmp_path)!r}) as ckpt:
            ckpt.save(1, state)
            ckpt.save(2, state)
        for path in pathlib.Path({str(tmp_path)!r}, "2").rglob("*"):
            if path.is_file():
                path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])
        jdp.Checkpointer({str(tmp_path)!r}).restore(state)
        print("restored")
    """)
    assert run.returncode == 0 and "restored" in run.stdout, run.stderr[-2000:]
    assert run.stderr.count("Skipped damaged checkpoint(s) step 2") == 1
    assert "Traceback" not in run.stderr and "ERROR:absl" not in run.stderr
    assert "Event loop is closed" not in run.stderr


# --- packaging ------------------------------------------------------------------


def test_every_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [dep for deps in project["optional-dependencies"].values() for dep in deps]
    declared = " ".join(project["dependencies"] + extras).lower()
    names = {"orbax": "orbax-checkpoint", "tensorboardX": "tensorboardx"}
    missing = set()
    for path in (ROOT / "jdp").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom) and getattr(node, "level", 0) == 0:
                mods = (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                )
                for mod in mods:
                    top = mod.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "jdp":
                        if path.name == "demo.py" and top in ("sklearn", "matplotlib"):
                            continue  # the demo extra
                        if names.get(top, top) not in declared:
                            missing.add(top)
    assert not missing


def test_version():
    from importlib.metadata import version

    assert jdp.__version__ == version("jdp")


def test_a_clone_named_jdp_next_to_a_script_does_not_shadow_the_package(tmp_path):
    (tmp_path / "jdp").symlink_to(ROOT)  # the folder that holds a clone called jdp/
    run = subprocess.run(
        [sys.executable, "-c", "import jdp; print(jdp.__file__, jdp.__version__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0].endswith(os.path.join("jdp", "__init__.py"))

"""Checkpointer: round trips, device counts, damage, mismatches, and kill-resume."""

import json
import os
import pathlib
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent


def trained_state(steps=3, n=8):
    variables = models.classifier_variables()
    state = jdp.TrainState.create(
        params=variables["params"],
        tx=optax.adam(1e-2),
        loss_scale=jdp.DynamicLossScale(
            jnp.float32(2.0**12), period=5, factor=3, min_loss_scale=8.0
        ),
        model_state=variables["batch_stats"],
        rng=jax.random.key(11),
    )
    step = jdp.pmap(
        jdp.make_train_step(models.classifier_train_loss, has_model_state=True, has_rng=True),
        devices=jax.local_devices()[:n],
    )
    state = step.replicate(state)
    for i in range(steps):
        state, _ = step(state, step.shard(models.classification_batch(32, seed=i)))
    return state


def host(tree):
    def get(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(get, tree)


def assert_identical(a, b):
    # Leaf by leaf, by path: the optax objects (static) may differ.
    la = jax.tree_util.tree_flatten_with_path(host(a))[0]
    lb = jax.tree_util.tree_flatten_with_path(host(b))[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_round_trip_restores_every_field_replicated_and_in_sync(tmp_path):
    state = trained_state()
    ckpt = jdp.Checkpointer(tmp_path)
    ckpt.save(3, state, extra={"position": 96, "config": {"lr": 0.01}})
    template = jdp.replicate(
        jdp.TrainState.create(
            params=jax.tree.map(jnp.zeros_like, jdp.unreplicate(state).params),
            tx=optax.adam(1e-2),
            loss_scale=jdp.DynamicLossScale(
                jnp.float32(16.0), period=5, factor=3, min_loss_scale=8.0
            ),
            model_state=jax.tree.map(jnp.zeros_like, jdp.unreplicate(state).model_state),
            rng=jax.random.key(0),
        )
    )
    restored, extra = ckpt.restore(template)
    assert extra == {"position": 96, "config": {"lr": 0.01}}
    assert restored.params["Dense_0"]["kernel"].shape[0] == 8
    jdp.assert_replicas_in_sync(restored)
    assert_identical(jdp.unreplicate(restored), jdp.unreplicate(state))
    scale = jdp.unreplicate(restored).loss_scale
    assert (scale.period, scale.factor, scale.min_loss_scale) == (5, 3, 8.0)
    assert int(jdp.unreplicate(restored).step) == 3


def test_written_on_8_devices_restores_on_4(tmp_path):
    state = trained_state()
    jdp.Checkpointer(tmp_path).save(3, state)
    template = jdp.replicate(jdp.unreplicate(trained_state(steps=0)), jax.local_devices()[:4])
    restored, _ = jdp.Checkpointer(tmp_path).restore(template)
    assert restored.step.shape == (4,)
    assert_identical(jdp.unreplicate(restored), jdp.unreplicate(state))
    # And it keeps training on 4 devices.
    step = jdp.pmap(
        jdp.make_train_step(models.classifier_train_loss, has_model_state=True, has_rng=True),
        devices=jax.local_devices()[:4],
    )
    restored, _ = step(restored, step.shard(models.classification_batch(32)))


def test_pmap_checkpoint_restores_under_shard_map_and_back(tmp_path):
    state = trained_state()
    ckpt = jdp.Checkpointer(tmp_path)
    ckpt.save(3, state)
    smap = jdp.shard_map(
        jdp.make_train_step(models.classifier_train_loss, has_model_state=True, has_rng=True)
    )
    template = smap.replicate(jdp.unreplicate(trained_state(steps=0)))
    restored, _ = ckpt.restore(template)
    assert restored.step.shape == () and restored.step.sharding.is_fully_replicated
    assert_identical(jdp.unreplicate(restored), jdp.unreplicate(state))
    restored, _ = smap(restored, smap.shard(models.classification_batch(32)))
    ckpt.save(4, restored)
    back, _ = ckpt.restore(state)
    assert back.step.shape == (8,) and int(jdp.unreplicate(back).step) == 4


def test_unreplicated_template_restores_replicated(tmp_path):
    state = trained_state()
    jdp.Checkpointer(tmp_path).save(3, state)
    restored, _ = jdp.Checkpointer(tmp_path).restore(jdp.unreplicate(trained_state(steps=0)))
    assert restored.step.shape == (8,)


def _corrupt(step_dir: pathlib.Path):
    for path in step_dir.rglob("*"):
        if path.is_file() and path.name not in ("commit_success.txt",):
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])


def test_truncated_newest_falls_back_with_a_warning(tmp_path):
    ckpt = jdp.Checkpointer(tmp_path)
    older, newer = trained_state(steps=1), trained_state(steps=2)
    ckpt.save(1, older)
    ckpt.save(2, newer)
    _corrupt(tmp_path / "2")
    with pytest.warns(
        RuntimeWarning, match=r"Skipped damaged checkpoint\(s\) step 2 .* restored step 1"
    ):
        restored, _ = jdp.Checkpointer(tmp_path).restore(older)
    assert_identical(jdp.unreplicate(restored), jdp.unreplicate(older))


def test_no_intact_checkpoint_is_an_error(tmp_path):
    ckpt = jdp.Checkpointer(tmp_path)
    state = trained_state(steps=1)
    ckpt.save(1, state)
    _corrupt(tmp_path / "1")
    with pytest.raises(jdp.CheckpointError, match=r"no intact checkpoint in .*step 1"):
        jdp.Checkpointer(tmp_path).restore(state)


def test_unfinished_write_is_invisible(tmp_path):
    ckpt = jdp.Checkpointer(tmp_path)
    state = trained_state(steps=1)
    ckpt.save(1, state)
    # What a write killed before Orbax's final rename leaves behind.
    (tmp_path / "2.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "2.orbax-checkpoint-tmp-1234" / "junk").write_bytes(b"\0" * 10)
    fresh = jdp.Checkpointer(tmp_path)
    assert fresh.all_steps() == [1]
    fresh.restore(state)


def test_missing_checkpoint_errors(tmp_path):
    state = trained_state(steps=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        jdp.Checkpointer(tmp_path).restore(state)
    jdp.Checkpointer(tmp_path).save(0, state)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 5 .* available: \[0\]"):
        jdp.Checkpointer(tmp_path).restore(state, step=5)


def test_template_with_other_shapes_names_the_leaf(tmp_path):
    jdp.Checkpointer(tmp_path).save(
        0, jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    other = jdp.TrainState.create(params=models.mlp_params(hidden=32), tx=optax.sgd(0.1))
    with pytest.raises(
        ValueError,
        match=r"leaf \.params\['b1'\]: saved shape \(16,\) dtype float32, template expects shape \(32,\) dtype float32",
    ):
        jdp.Checkpointer(tmp_path).restore(other)


def test_template_with_other_dtype_names_the_leaf(tmp_path):
    jdp.Checkpointer(tmp_path).save(
        0, jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), models.mlp_params())
    with pytest.raises(
        ValueError,
        match=r"\['b1'\]: saved shape \(16,\) dtype float32, template expects shape \(16,\) dtype bfloat16",
    ):
        jdp.Checkpointer(tmp_path).restore(jdp.TrainState.create(params=half, tx=optax.sgd(0.1)))


def test_template_of_another_model_names_the_missing_leaf(tmp_path):
    jdp.Checkpointer(tmp_path).save(
        0, jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    other = jdp.TrainState.create(
        params={**models.mlp_params(), "w3": jnp.zeros(2)}, tx=optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match=r"has no leaf \.params\['w3'\]"):
        jdp.Checkpointer(tmp_path).restore(other)


def test_changed_loss_scale_hyperparameters_are_an_error(tmp_path):
    state = trained_state(steps=0)
    jdp.Checkpointer(tmp_path).save(0, state)
    other = jdp.unreplicate(state).replace(
        loss_scale=jdp.DynamicLossScale(jnp.float32(16.0), period=6, factor=3, min_loss_scale=8.0)
    )
    with pytest.raises(
        ValueError, match=r"static settings .*'period': 5.* template has .*'period': 6"
    ):
        jdp.Checkpointer(tmp_path).restore(other)


def test_max_to_keep(tmp_path):
    ckpt = jdp.Checkpointer(tmp_path, max_to_keep=2)
    state = trained_state(steps=0)
    for step in range(5):
        ckpt.save(step, state)
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["3", "4"]


def test_async_save_then_wait(tmp_path):
    state = trained_state(steps=1)
    with jdp.Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        restored, _ = ckpt.restore(state)
    assert_identical(jdp.unreplicate(restored), jdp.unreplicate(state))


def test_bad_arguments(tmp_path):
    ckpt = jdp.Checkpointer(tmp_path)
    state = trained_state(steps=0)
    with pytest.raises(TypeError, match="extra must be JSON-serializable"):
        ckpt.save(0, state, extra={"array": np.zeros(2)})
    ckpt.save(0, state)
    with pytest.raises(ValueError, match="checkpoint 0 already exists"):
        ckpt.save(0, state)
    with pytest.raises(ValueError, match="max_to_keep must be None or an int >= 1, got 0"):
        jdp.Checkpointer(tmp_path, max_to_keep=0)


def test_checkpoints_contain_no_pickles(tmp_path):
    jdp.Checkpointer(tmp_path).save(0, trained_state(steps=1), extra={"note": "x"})
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files
    for path in files:
        head = path.read_bytes()[:2]
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), path
        assert path.suffix not in (".pkl", ".pickle", ".npy"), path
    meta = json.loads((tmp_path / "0" / "meta" / "metadata").read_text())
    assert meta["extra"] == {"note": "x"}


def _run(directory, steps, resume=False, kill_after=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "scripts" / "resume_run.py"),
        str(directory),
        str(steps),
    ]
    if resume:
        cmd.append("--resume")
    code, lines, errors = models.run_killable(cmd, env, kill_after)
    if kill_after is None:
        assert code == 0, errors[-3000:]
    else:
        assert code == -signal.SIGKILL
    return lines


def test_killed_run_resumes_to_the_bit_identical_result(tmp_path):
    _run(tmp_path / "straight", 32)
    killed = tmp_path / "killed"
    _run(killed, 32, kill_after=18)  # SIGKILL between the checkpoints at 15 and 20
    assert not (killed / "final.npz").exists()
    lines = _run(killed, 32, resume=True)
    assert lines[0] in ("resumed 15", "resumed 10")  # 15 unless its async write was cut short
    a, b = np.load(tmp_path / "straight" / "final.npz"), np.load(killed / "final.npz")
    assert int(a["skipped"]) >= 2 and sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

"""fit and the step, opened up: any state, any iterator, callbacks, custom steps."""

import os
import pathlib
import signal
import struct
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent


class EMAState(jdp.TrainState):
    """The Flax way of extending the state: a subclass with a field."""

    ema: Any = None


def ema_step(decay=0.5):
    inner = jdp.make_train_step(models.mlp_loss)

    def step(state, batch):
        state, metrics = inner(state, batch)
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state.ema, state.params)
        return state.replace(ema=ema), metrics

    return step


def test_a_subclassed_state_replicates_trains_checkpoints_and_fits(backend, tmp_path):
    state = EMAState.create(params=models.mlp_params(), tx=optax.sgd(0.1), ema=models.mlp_params())
    assert jax.tree.structure(state) != jax.tree.structure(
        jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1))
    )
    step = models.backend(backend, ema_step(), 8)
    data = [models.regression_batch(32, seed=80 + i) for i in range(3)]
    with jdp.Checkpointer(tmp_path) as ckpt:
        final, history = jdp.fit(
            step,
            step.replicate(state),
            iter(data),
            num_steps=3,
            checkpointer=ckpt,
            log_every=1,
            progress=False,
        )
        restored, _ = ckpt.restore(step.replicate(state))
    assert isinstance(final, EMAState) and len(history.train) == 3
    # The EMA, by hand, over the reference trajectory.
    params, ema = models.mlp_params(), models.mlp_params()
    tx = optax.sgd(0.1)
    opt = tx.init(params)
    for batch in data:
        grads = jax.grad(models.mlp_loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, ema, params)
    models.assert_trees_close(step.unreplicate(final).ema, ema, rtol=1e-5, atol=1e-7)
    models.assert_trees_close(step.unreplicate(restored).ema, ema, rtol=1e-5, atol=1e-7)


def test_fit_with_a_dict_state_and_a_custom_step():
    tx = optax.sgd(0.1)

    def custom(state, batch):
        grads = jdp.reduce_gradients(
            jax.grad(models.mlp_loss)(state["params"], batch), "batch", "mean"
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {
            "params": optax.apply_updates(state["params"], updates),
            "opt": opt,
            "step": state["step"] + 1,
        }
        return new, {"loss": models.mlp_loss(state["params"], batch)}

    state = {
        "params": models.mlp_params(),
        "opt": tx.init(models.mlp_params()),
        "step": jnp.zeros((), jnp.int32),
    }
    step = jdp.pmap(custom)
    data = [models.regression_batch(32, seed=90 + i) for i in range(4)]
    final, history = jdp.fit(
        step, step.replicate(state), iter(data), num_steps=4, log_every=2, progress=False
    )
    expected, _ = models.train_single_device(models.mlp_loss, models.mlp_params(), tx, data)
    models.assert_trees_close(step.unreplicate(final)["params"], expected, rtol=1e-5, atol=1e-7)
    assert [row["step"] for row in history.train] == [2, 4]


def test_rows_read_one_step_late_hold_each_logged_steps_own_metrics(backend):
    """fit reads a logged step's metrics after dispatching the next step; the rows
    still hold that step's loss (the loss before its update, by hand), in order,
    and a train row comes before the evaluation of the same step."""
    data = [models.regression_batch(32, seed=300 + i) for i in range(7)]
    step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    eval_step = models.backend(
        backend,
        jdp.make_eval_step(
            lambda p, b: {"loss": jnp.mean((models.mlp_forward(p, b) - b["y"]) ** 2, axis=-1)}
        ),
        8,
    )
    seen = []
    tx = optax.sgd(0.1)
    _, history = jdp.fit(
        step,
        step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=tx)),
        iter(data),
        num_steps=7,
        log_every=3,
        eval_step=eval_step,
        eval_data=lambda: [data[0]],
        eval_every=3,
        callbacks=[lambda row: seen.append((row["split"], row["step"]))],
        progress=False,
    )
    assert seen == [("train", 3), ("eval", 3), ("train", 6), ("eval", 6), ("train", 7), ("eval", 7)]
    params, by_hand = models.mlp_params(), {}
    for i, batch in enumerate(data, start=1):
        loss, grads = jax.value_and_grad(models.mlp_loss)(params, batch)
        by_hand[i] = float(loss)
        params = optax.apply_updates(params, tx.update(grads, tx.init(params))[0])
    for row in history.train:
        np.testing.assert_allclose(row["loss"], by_hand[row["step"]], rtol=1e-5)
    assert all(row["examples_per_s"] > 0 for row in history.train)


def _kill_resume(tmp_path, kind):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)

    def run(directory, kill_after=None):
        cmd = [
            sys.executable,
            str(ROOT / "tests" / "scripts" / "fit_resume_run.py"),
            str(directory),
            "23",
            kind,
        ]
        code, lines, errors = models.run_killable(cmd, env, kill_after)
        assert code == (0 if kill_after is None else -signal.SIGKILL), errors[-3000:]
        return lines

    run(tmp_path / "straight")
    run(tmp_path / "killed", kill_after=13)  # checkpoints at 5 and 10 are on disk
    lines = run(tmp_path / "killed")
    assert lines[0] == "step 11"  # resumed after checkpoint 10
    a = np.load(tmp_path / "straight" / "final.npz")
    b = np.load(tmp_path / "killed" / "final.npz")
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("kind", ["grain", "custom"])
def test_fit_killed_and_resumed_is_bit_identical(tmp_path, kind):
    _kill_resume(tmp_path, kind)


def _read_scalars(logdir, text=False):
    """Every (tag, step, value) in the tfevents files: TFRecord framing, Event protos.

    ``text``: the text summaries instead, their strings as values.
    """
    from tensorboardX.proto import event_pb2

    out = []
    for path in pathlib.Path(logdir).glob("events.out.tfevents.*"):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if text and value.tensor.string_val:
                    out.append((value.tag, event.step, value.tensor.string_val[0].decode()))
                elif not text and not value.tensor.string_val:
                    out.append((value.tag, event.step, value.simple_value))
    return out


def test_tensorboard_file_holds_the_logged_losses_and_fingerprints(tmp_path):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss, metrics=[jdp.metrics.fingerprint()]))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    eval_step = jdp.pmap(
        jdp.make_eval_step(
            lambda p, b: {"mse": jnp.mean((models.mlp_forward(p, b) - b["y"]) ** 2, axis=-1)}
        )
    )
    logger = jdp.TensorBoardLogger(tmp_path)
    _, history = jdp.fit(
        step,
        state,
        jdp.BatchIterator(models.regression_batch(64), 32),
        num_steps=4,
        eval_step=eval_step,
        eval_data=lambda: [models.regression_batch(16)],
        callbacks=[logger],
        log_every=2,
        progress=False,
    )
    logger.close()
    scalars = _read_scalars(tmp_path)
    losses = [(s, v) for tag, s, v in scalars if tag == "train/loss"]
    assert losses == [(row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in history.train]
    assert [(s, pytest.approx(v, rel=1e-6)) for tag, s, v in scalars if tag == "eval/mse"] == [
        (4, history.eval[0]["mse"])
    ]
    # A fingerprint is written exactly, as text: two uint32 words.
    texts = [(s, v) for tag, s, v in _read_scalars(tmp_path, text=True) if "fingerprint" in tag]
    assert texts == [(r["step"], " ".join(map(str, r["fingerprint"]))) for r in history.train]


def test_learning_rate_in_the_metrics():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    batch = models.regression_batch(16)
    for tx, source in [
        (optax.sgd(schedule), schedule),
        (optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), True),
    ]:
        step = jdp.pmap(jdp.make_train_step(models.mlp_loss, log_learning_rate=source))
        state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=tx))
        rates = []
        for _ in range(3):
            state, metrics = step(state, step.shard(batch))
            rates.append(float(metrics["learning_rate"][0]))
        assert rates == pytest.approx([1.0, 0.9, 0.8])
    with pytest.raises(ValueError, match="wrap it, optax.inject_hyperparams"):
        step = jdp.pmap(jdp.make_train_step(models.mlp_loss, log_learning_rate=True))
        step(
            step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(1.0))),
            step.shard(batch),
        )


def test_grad_norm_metric():
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss, log_grad_norm=True))
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.1)))
    batch = models.regression_batch(32)
    _, metrics = step(state, step.shard(batch))
    expected = optax.tree.norm(jax.grad(models.mlp_loss)(models.mlp_params(), batch))
    np.testing.assert_allclose(metrics["grad_norm"], float(expected), rtol=1e-5)


def test_custom_step_from_apply_gradients_equals_the_built_in_bit_for_bit(backend):
    def custom(state, batch):
        scaled = lambda p: state.loss_scale.scale(models.mlp_loss(p, batch))  # noqa: E731
        grads = jax.grad(scaled)(state.params)
        grads = state.loss_scale.unscale(jdp.reduce_gradients(grads, "batch", "mean"))
        return jdp.apply_gradients(state, grads)

    data = [models.regression_batch(32, seed=100 + i) for i in range(4)]
    data[1]["x"][5, 2] = np.inf  # an overflow on one replica: the step is skipped
    results = []
    for step_fn in (custom, jdp.make_train_step(models.mlp_loss)):
        step = models.backend(backend, step_fn, 8)
        state = step.replicate(
            jdp.TrainState.create(
                params=models.mlp_params(),
                tx=optax.adam(1e-2),
                loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**10), period=2),
            )
        )
        for batch in data:
            state, _ = step(state, step.shard(batch))
        results.append(jax.device_get(step.unreplicate(state)))
    custom_state, built_in = results
    assert int(built_in.skipped_steps) == 1
    for a, b in zip(jax.tree.leaves(custom_state), jax.tree.leaves(built_in), strict=True):
        np.testing.assert_array_equal(a, b)

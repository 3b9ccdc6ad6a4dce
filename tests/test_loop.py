"""fit: progress, evaluation, epoch hooks, checkpoints and resume; the demo end to end."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp
from tests import models

DATA = models.regression_batch(200, seed=7)
TEST = models.regression_batch(45, seed=8)


def per_example_error(params, batch):
    err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
    return {"mse": jdp.weighted_mean(err, batch["mask"])}


def run_fit(num_steps, checkpointer=None, epochs=None, backend="pmap"):
    train_step = models.backend(backend, jdp.make_train_step(models.mlp_loss), 8)
    eval_step = models.backend(backend, jdp.make_eval_step(per_example_error), 8)
    state = train_step.replicate(
        jdp.TrainState.create(
            params=models.mlp_params(),
            tx=optax.adam(1e-2),
            loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**8), period=7),
        )
    )

    def on_epoch_end(epoch, state):
        if epochs is not None:
            epochs.append((epoch, int(jdp.unreplicate(state).step)))

    return jdp.fit(
        train_step,
        state,
        jdp.BatchIterator(DATA, 32, seed=1),
        num_steps=num_steps,
        eval_step=eval_step,
        eval_data=lambda: jdp.BatchIterator(TEST, 16, shuffle=False, remainder="pad", repeat=False),
        eval_every=10,
        checkpointer=checkpointer,
        checkpoint_every=10 if checkpointer is not None else None,
        on_epoch_end=on_epoch_end,
        log_every=5,
        progress=False,
    )


def test_fit_trains_logs_and_evaluates(backend):
    epochs = []
    state, history = run_fit(30, epochs=epochs, backend=backend)
    assert int(jdp.unreplicate(state).step) == 30
    assert [row["step"] for row in history.train] == [5, 10, 15, 20, 25, 30]
    assert len(history.train[0]["loss_per_replica"]) == 8
    assert history.train[0]["loss"] == pytest.approx(np.mean(history.train[0]["loss_per_replica"]))
    assert [row["step"] for row in history.eval] == [10, 20, 30]
    assert all(row["weights"] == {"mse": 45.0} for row in history.eval)
    assert history.eval[-1]["mse"] < history.eval[0]["mse"]
    # 200 examples, batches of 32: 6 per epoch; the hook runs after steps 6, 12, ...
    assert epochs == [(1, 6), (2, 12), (3, 18), (4, 24), (5, 30)]


def test_fit_resumes_from_the_latest_checkpoint_to_the_same_result(tmp_path):
    straight, _ = run_fit(30)
    with jdp.Checkpointer(tmp_path) as ckpt:
        run_fit(20, checkpointer=ckpt)
    with jdp.Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 20
        resumed, history = run_fit(30, checkpointer=ckpt)
        assert ckpt.all_steps() == [10, 20, 30]
    # The history comes back with the checkpoint: the curves continue.
    assert [row["step"] for row in history.train] == [5, 10, 15, 20, 25, 30]
    assert [row["step"] for row in history.eval] == [10, 20, 30]
    assert history.resumed_at == [20]
    a, b = jdp.unreplicate(straight), jdp.unreplicate(resumed)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.params), jax.device_get(b.params))
    assert float(a.loss_scale.loss_scale) == float(b.loss_scale.loss_scale)


def test_logged_loss_is_the_single_device_loss_on_real_examples(backend):
    """Padding: the logged global loss and throughput count real examples only."""

    def loss_fn(params, batch):
        err = jnp.mean((models.mlp_forward(params, batch) - batch["y"]) ** 2, axis=-1)
        return jdp.weighted_mean(err, batch["mask"])

    data = models.regression_batch(45, seed=3)  # 45 = 32 + 13: the second batch is padded
    step = models.backend(backend, jdp.make_train_step(loss_fn), 8)
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.sgd(0.0)))
    iterator = jdp.BatchIterator(data, 32, shuffle=False, remainder="pad")
    _, history = jdp.fit(step, state, iterator, num_steps=2, log_every=1, progress=False)
    for row, rows in zip(history.train, [slice(0, 32), slice(32, 45)], strict=True):
        real = jax.tree.map(lambda x, rows=rows: x[rows], data)
        assert row["loss"] == pytest.approx(
            float(models.mlp_loss(models.mlp_params(), real)), rel=1e-6
        )
        assert row["weight"] == rows.stop - rows.start
        assert "weight_per_s" in row and "examples_per_s" not in row


def test_demo_end_to_end(tmp_path):
    from jdp import demo

    # The default run, as `make demo` runs it (only the output folder differs).
    result = demo.main(["--out", str(tmp_path), "--quiet", "--compilation-cache", ""])
    assert result["test_examples"] == 357 and result["steps"] == 600
    assert result["test_accuracy"] >= 0.98
    # The default trains in exact mode: 1 device and 8 end bit for bit equal
    # (the ordinary step's rounding grew to 2.4e-2 after 600 steps).
    assert result["precision"] == "float32" and result["exact_mode"]
    assert result["bitwise_equal"] and result["max_param_diff"] == 0.0
    assert result["reference_test_accuracy"] == result["test_accuracy"]
    assert len(result["per_replica_loss"]) == 8
    # The figure depends only on the run: the README's image is this run's.
    import matplotlib.image

    drawn = matplotlib.image.imread(tmp_path / "promises.png")
    readme = matplotlib.image.imread(pathlib.Path(__file__).parent.parent / "docs/images/demo.png")
    # XLA:CPU compiles for the CPU's instruction set, so another kind of CPU
    # ends the 600 steps with other bits (measured: an AVX2-only AMD EPYC
    # redraws 0.4% of the pixels by more than a quarter of their range, one
    # evaluation point moves by one digit). A stale image after a change of
    # the demo moves far more (a panel, a title, the curves).
    assert drawn.shape == readme.shape, "docs/images/demo.png is stale: run make demo"
    moved = np.mean(np.max(np.abs(drawn - readme), axis=2) > 0.25)
    assert moved < 0.01, f"docs/images/demo.png is stale ({moved:.1%} of pixels): run make demo"
    assert (
        json.loads((tmp_path / "result.json").read_text())["test_accuracy"]
        == result["test_accuracy"]
    )
    assert result["checkpoint_steps"][-1] == 600
    with jdp.Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.latest_step() == 600


def test_demo_help_explains_the_flags():
    out = subprocess.run(
        [sys.executable, "-m", "jdp.demo", "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--devices", "--steps", "--batch-size", "--precision", "--out", "--backend"):
        assert flag in out.stdout

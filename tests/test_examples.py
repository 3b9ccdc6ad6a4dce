"""The examples' tiny configurations, each in a fresh process: they train to a stated loss,
the strategies agree, and a second run with the same --out resumes from its checkpoint."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LM_TINY = ["--size", "tiny", "--batch-size", "32", "--lr", "3e-3", "--warmup", "20"]
# The corpus's byte-unigram entropy is 3.15 nats; 200 tiny steps reach 2.51 (examples/lm/README.md).
LM_TINY_EVAL_LOSS = 2.6


def run_lm(out, *flags, timeout=300):
    cmd = [
        sys.executable,
        str(ROOT / "examples/lm/train.py"),
        "--out",
        str(out),
        "--cpu-devices",
        "8",
    ]
    cmd += [*LM_TINY, "--eval-every", "100", "--checkpoint-every", "100", "--no-progress", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def lm_reference(tmp_path_factory):
    return run_lm(tmp_path_factory.mktemp("lm_dp"), "--steps", "200")


def test_lm_tiny_reaches_its_stated_loss(lm_reference):
    assert lm_reference["eval"]["step"] == 200
    assert lm_reference["eval"]["loss"] < LM_TINY_EVAL_LOSS
    assert lm_reference["parameters"] == 120_576


def test_lm_fsdp_killed_and_resumed_is_the_same_training(lm_reference, tmp_path):
    first = run_lm(tmp_path, "--strategy", "fsdp", "--steps", "100", "--decay-steps", "200")
    assert first["resumed_at"] == [] and first["eval"]["step"] == 100
    resumed = run_lm(tmp_path, "--strategy", "fsdp", "--steps", "200")
    assert resumed["resumed_at"] == [100]
    # The strategies agree to 1e-8 here (examples/lm/README.md); 1e-6 as fsdp promises.
    np.testing.assert_allclose(resumed["eval"]["loss"], lm_reference["eval"]["loss"], rtol=1e-6)
    np.testing.assert_allclose(resumed["train_loss"], lm_reference["train_loss"], rtol=1e-6)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 2 and all(e.stat().st_size > 0 for e in events)


RESNET_TINY = ["--size", "tiny", "--image-size", "8", "--batch-size", "64", "--lr", "3e-3"]
RESNET_TINY += ["--warmup", "20", "--weight-decay", "0.05", "--decay-steps", "200"]
# 200 tiny steps reach eval loss 0.162 and accuracy 0.966 (examples/resnet/README.md).
RESNET_TINY_EVAL_LOSS, RESNET_TINY_ACCURACY = 0.25, 0.95


def run_resnet(out, *flags, timeout=300):
    cmd = [sys.executable, str(ROOT / "examples/resnet/train.py"), "--out", str(out)]
    cmd += ["--cpu-devices", "8", *RESNET_TINY, "--eval-every", "100", "--checkpoint-every"]
    cmd += ["100", "--no-progress", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_resnet_tiny_reaches_its_stated_loss(tmp_path):
    summary = run_resnet(tmp_path, "--steps", "200")
    assert summary["parameters"] == 19_706
    assert summary["eval"]["step"] == 200 and summary["eval"]["weights"]["accuracy"] == 357
    assert summary["eval"]["loss"] < RESNET_TINY_EVAL_LOSS
    assert summary["eval"]["accuracy"] >= RESNET_TINY_ACCURACY


def test_resnet_exact_stopped_and_resumed_is_bitwise_the_same_run(tmp_path):
    # 40 steps, stopped at 20 (argparse keeps an option's last value).
    short = ["--strategy", "exact", "--decay-steps", "40", "--eval-every", "20"]
    short += ["--checkpoint-every", "20"]
    whole = run_resnet(tmp_path / "whole", *short, "--steps", "40")
    run_resnet(tmp_path / "split", *short, "--steps", "20")
    resumed = run_resnet(tmp_path / "split", *short, "--steps", "40")
    assert resumed["resumed_at"] == [20]
    assert resumed["eval"] == whole["eval"]
    assert resumed["train_loss"] == whole["train_loss"]

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
    np.testing.assert_allclose(resumed["eval"]["loss"], lm_reference["eval"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(resumed["train_loss"], lm_reference["train_loss"], rtol=1e-5)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 2 and all(e.stat().st_size > 0 for e in events)

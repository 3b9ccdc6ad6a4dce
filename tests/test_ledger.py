"""Where the time went: fit's ledger adds up to the wall time, also across a restart."""

import json
import pathlib
import subprocess
import sys
import time

import optax
import pytest

import jdp
from jdp import _ledger
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA_SLEEP, EVAL_SLEEP, STEPS = 0.03, 0.2, 20


def slow(data, seconds):
    for batch in data:
        time.sleep(seconds)
        yield batch


def test_the_buckets_add_up_to_the_wall_time_and_see_each_kind(tmp_path):
    step = jdp.pmap(jdp.make_train_step(models.mlp_loss))
    eval_step = jdp.pmap(
        jdp.make_eval_step(
            lambda p, b: {"mse": ((models.mlp_forward(p, b) - b["y"]) ** 2).mean(axis=-1)}
        )
    )
    state = step.replicate(jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-2)))
    data = jdp.BatchIterator(models.regression_batch(256, seed=2), 32, seed=0)
    rows = []
    with jdp.Checkpointer(tmp_path) as ckpt:
        start = time.perf_counter()
        _, history = jdp.fit(
            step,
            state,
            slow(data, DATA_SLEEP),
            num_steps=STEPS,
            eval_step=eval_step,
            eval_data=lambda: slow(
                [models.regression_batch(32, seed=s) for s in (5, 6)], EVAL_SLEEP
            ),
            eval_every=10,
            checkpointer=ckpt,
            checkpoint_every=10,
            callbacks=[rows.append],
            log_every=5,
            progress=False,
        )
        wall = time.perf_counter() - start
    seconds = history.time
    assert set(seconds) == set(_ledger.KINDS)
    assert _ledger.total(seconds) == pytest.approx(wall, rel=0.01)
    # fit reads one batch ahead (prefetching): the first batch's wait is start-up,
    # and the last prefetch may not be waited for.
    assert DATA_SLEEP * (STEPS - 2) <= seconds["data"] <= DATA_SLEEP * STEPS + 0.5
    assert 2 * 2 * EVAL_SLEEP <= seconds["eval"] <= 2 * 2 * EVAL_SLEEP + 2.0  # 2 evals x 2 batches
    assert seconds["compile"] > 0.05 and seconds["save"] > 0 and seconds["train"] > 0
    assert seconds["restore"] == seconds["redone"] == seconds["restart"] == seconds["idle"] == 0
    # Each train row holds the ledger as of its step; the history's is the end's.
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all(set(r["time"]) == set(_ledger.KINDS) for r in train)
    totals = [_ledger.total(r["time"]) for r in train]
    assert totals == sorted(totals) and totals[-1] < _ledger.total(seconds)
    # The file beside the checkpoints says the run finished, with the same totals.
    record = json.loads((tmp_path / _ledger.FILE).read_text())
    assert record["finished"] and record["seconds"] == seconds
    assert sorted(record["saves"]) == ["10", "20"]


def run(directory, steps, die_at):
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/scripts/ledger_run.py"),
            str(directory),
            str(steps),
            str(die_at),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
    )


def test_a_restart_charges_the_lost_steps_to_redone_and_still_adds_up(tmp_path):
    died = run(tmp_path, 30, 17)  # checkpoint 10 saved, steps 11..17 lost
    assert died.returncode == 3, died.stderr[-3000:]
    first = json.loads((tmp_path / "ckpt" / _ledger.FILE).read_text())
    assert not first["finished"]
    lost = _ledger.total(first["seconds"]) - _ledger.total(first["saves"]["10"])
    time.sleep(1.0)  # the gap a launcher's restart would take
    done = run(tmp_path, 30, 0)
    assert done.returncode == 0, done.stderr[-3000:]
    (times_file,) = tmp_path.glob("times-*.json")
    times = json.loads(times_file.read_text())
    (start_file,) = [p for p in tmp_path.glob("start-*.txt") if p.stem[6:] != times_file.stem[6:]]
    seconds = times["ledger"]
    wall = times["end"] - float(start_file.read_text())
    assert _ledger.total(seconds) == pytest.approx(wall, rel=0.01)
    assert seconds["redone"] == pytest.approx(lost, rel=1e-9)
    # The restart: from the dead run's last record to the new fit call (its imports, 1 s).
    assert 1.0 <= seconds["restart"] <= wall
    assert seconds["restore"] > 0 and seconds["idle"] == 0


def test_a_resumed_record_continues_from_the_save_it_restores(tmp_path):
    record = _ledger.Record(tmp_path, writer=True)
    record.write({"train": 6.0, "save": 1.0}, saved=10)
    record.write({"train": 9.0, "save": 1.0})  # after the save: lost if the run dies now
    seconds = _ledger.Record(tmp_path, writer=True).resumed(10, {"train": 5.0}, time.time())
    assert seconds["train"] == 6.0 and seconds["save"] == 1.0  # the file's snapshot wins
    assert seconds["redone"] == pytest.approx(3.0) and 0 <= seconds["restart"] < 5
    record.write({"train": 9.0, "save": 1.0}, finished=True)
    later = _ledger.Record(tmp_path, writer=True).resumed(10, None, time.time())
    assert "restart" not in later and 0 <= later["idle"] < 5


@pytest.mark.parametrize("content", ["", "{not json", '{"seconds": 3}', "[1, 2]"])
def test_a_damaged_ledger_file_costs_the_lost_time_only(tmp_path, content):
    (tmp_path / _ledger.FILE).write_text(content)
    seconds = _ledger.Record(tmp_path, writer=True).resumed(10, {"train": 5.0}, time.time())
    assert seconds == {"train": 5.0}


def test_only_the_writer_writes(tmp_path):
    _ledger.Record(tmp_path, writer=False).write({"train": 1.0}, finished=True)
    assert not (tmp_path / _ledger.FILE).exists()

"""Where the time went: ``jdp.fit``'s wall time by kind, kept across restarts.

One clock, one current kind: :meth:`Ledger.enter` charges the time since the
last switch to the kind being left, so the buckets add up to the wall time
by construction, and a switch costs two ``perf_counter`` calls.

Across restarts the checkpoint is the source of truth for completed work:
each checkpoint's history holds the ledger as of that save. A small file
beside the checkpoints (``ledger.json``, written by process 0 at each
logged row, save and the end) adds what a failed attempt did after its last
save, which the next attempt charges to ``redone``, and when it last wrote,
so the gap until the next attempt starts is charged to ``restart`` (or to
``idle`` when the attempt before had finished).
"""

import contextlib
import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

KINDS = (
    "startup",  # fit's set-up before the first step: checks, placement, the data's first batch
    "compile",  # the first call of the training step (tracing and compilation)
    "restore",  # reading the checkpoint a run resumes from
    "data",  # waiting for the next batch
    "train",  # dispatching steps and reading their metrics back
    "eval",  # evaluation, its compilation included
    "save",  # checkpoint saves (the blocking part) and the wait for them at the end
    "hooks",  # on_epoch_end
    "redone",  # what an earlier attempt computed after its last checkpoint: lost, trained again
    "restart",  # from a failed attempt's last record to the next attempt's start
    "idle",  # from a finished run's end to a later fit call that continues it
)
FILE = "ledger.json"
_KEEP_SAVES = 8  # the last saves' snapshots kept in the file: resume restores the latest


class Ledger:
    """Wall seconds by kind, the current kind charged until the next :meth:`enter`."""

    def __init__(self, seconds: Mapping[str, float] | None = None, kind: str = "startup"):
        self.seconds = {k: 0.0 for k in KINDS} | dict(seconds or {})
        self.kind, self._since = kind, time.perf_counter()
        self.started = time.time()  # wall clock: where a gap since an earlier run ends

    def enter(self, kind: str) -> None:
        now = time.perf_counter()
        self.seconds[self.kind] += now - self._since
        self.kind, self._since = kind, now

    def add(self, before: Mapping[str, float]) -> None:
        """Continues a ledger: ``before`` (earlier runs' buckets) joins this run's."""
        for kind, seconds in before.items():
            self.seconds[kind] = self.seconds.get(kind, 0.0) + float(seconds)

    def totals(self) -> dict[str, float]:
        """The buckets now, the current kind charged up to this moment (the clock goes on)."""
        self.enter(self.kind)
        return dict(self.seconds)


def total(seconds: Mapping[str, float]) -> float:
    return float(sum(seconds.values()))


def summary(seconds: Mapping[str, float]) -> str:
    """One line: the total and each nonzero kind with its share, largest first."""
    whole = total(seconds) or 1e-12
    parts = sorted(((v, k) for k, v in seconds.items() if v >= 5e-4), reverse=True)
    shown = ", ".join(f"{k} {v:.2f} s ({100 * v / whole:.0f}%)" for v, k in parts)
    return f"{whole:.2f} s: {shown}"


class Record:
    """``ledger.json`` in a checkpoint directory (written by process 0 only)."""

    def __init__(self, directory: pathlib.Path, writer: bool):
        self.path, self.writer = directory / FILE, writer
        self.saves: dict[str, dict[str, float]] = {}

    def resumed(
        self, step: int, saved: Mapping[str, float] | None, started: float
    ) -> dict[str, float]:
        """The ledger to continue from after restoring checkpoint ``step``.

        ``saved``: the ledger the checkpoint's history holds (None: none);
        ``started``: when this run's ledger started (``time.time()``), where
        the gap since the earlier run's last record ends.
        """
        before = self._read()
        base = dict(before.get("saves", {}).get(str(step)) or saved or {})
        self.saves = dict(before.get("saves", {}))
        if not before:
            return base
        base["redone"] = base.get("redone", 0.0) + max(total(before["seconds"]) - total(base), 0)
        gap = "idle" if before.get("finished") else "restart"
        base[gap] = base.get(gap, 0.0) + max(started - before["wall"], 0.0)
        return base

    def write(self, seconds: Mapping[str, float], *, saved: int | None = None, finished=False):
        if not self.writer:
            return
        if saved is not None:
            self.saves[str(saved)] = dict(seconds)
            self.saves = dict(list(self.saves.items())[-_KEEP_SAVES:])
        record = {"seconds": dict(seconds), "wall": time.time(), "finished": finished}
        record["saves"] = self.saves
        partial = self.path.with_name(f".{FILE}.{os.getpid()}")
        with contextlib.suppress(OSError):  # a full disk costs the ledger, never the run
            partial.write_text(json.dumps(record))
            os.replace(partial, self.path)

    def _read(self) -> dict[str, Any]:
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        ok = isinstance(record, dict) and isinstance(record.get("seconds"), dict)
        return record if ok and isinstance(record.get("wall"), (int, float)) else {}

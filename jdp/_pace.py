"""Who sets the pace: a process that stays slower than its peers, named while the job runs.

In a synchronous job every process waits for the slowest at the next
collective, so every process's step takes the same time and step times name
no one. What differs is where each process waits: the slow one waits for its
own data or computes, the others wait for it inside the step's first
collective. ``jdp.fit`` charges each process's host time to its ledger
(:mod:`jdp._ledger`) and, on its timed steps, reads from the device how long
the process computed before the first collective and how long it then
waited in it (:mod:`jdp._stamps`). At every logged step each process
publishes both in JAX's key-value store (no collective, nothing the device
waits for), and process 0 compares the windows between them.

The rule: over a window, a process's own time per step (its data wait per
step plus its compute per timed step) exceeds the median of its peers' by
more than ``SHARE`` of the step time (and ``FLOOR`` seconds) in ``WINDOWS``
windows in a row. Comparing processes within the same window cancels what
the whole machine does (a noisy neighbour slows everyone alike); requiring
consecutive windows keeps one hiccup from being named.
"""

import dataclasses
import json
import statistics
from collections.abc import Mapping

SHARE = 0.05  # of the step time: a process slower by 10% is named, by 5% not reliably
FLOOR = 2e-3  # seconds per step: below this, a wait is timer and scheduler noise
WINDOWS = 3  # consecutive windows (logged steps) before a process is named


@dataclasses.dataclass(frozen=True)
class Sample:
    """One process's totals at one logged step, in seconds.

    ``data`` waiting for data and ``total`` in all (its ledger); over its
    ``timed`` steps so far, ``compute`` before the first collective and
    ``collective`` waiting in it (:class:`jdp._stamps.Timing`).
    """

    step: int
    data: float
    total: float
    compute: float = 0.0
    collective: float = 0.0
    timed: int = 0

    def encode(self) -> str:
        return json.dumps(dataclasses.astuple(self))

    @classmethod
    def decode(cls, text: str) -> "Sample | None":
        try:
            step, data, total, *timing = json.loads(text)
            compute, collective, timed = timing or (0.0, 0.0, 0)
            timing_ = (float(compute), float(collective), int(timed))
            return cls(int(step), float(data), float(total), *timing_)
        except (ValueError, TypeError):
            return None


@dataclasses.dataclass(frozen=True)
class Window:
    """What one process did between two of its samples: per step, and per timed step."""

    steps: tuple[int, int]
    data: float
    step_time: float
    compute: float = 0.0
    collective: float = 0.0

    @property
    def own(self) -> float:
        """The time per step the process itself takes: waiting for its data, computing."""
        return self.data + self.compute


class Pace:
    """Process 0's view: each process's last sample and how many windows in a row it was slow."""

    def __init__(self) -> None:
        self.last: dict[int, Sample] = {}
        self.strikes: dict[int, int] = {}
        self.named: int | None = None
        self.windows: dict[int, Window] = {}  # each process's newest window

    def observe(self, samples: Mapping[int, Sample]) -> tuple[int, dict[int, Window]] | None:
        """Takes every process's newest sample; ``(process, windows)`` when one is newly named."""
        windows = {}
        for index, sample in samples.items():
            before = self.last.get(index)
            if before is not None and sample.step > before.step:
                windows[index] = _window(before, sample)
            if before is None or sample.step > before.step:
                self.last[index] = sample
        self.windows.update(windows)
        if len(windows) < 2:
            return None
        step_time = statistics.median(w.step_time for w in windows.values())
        for index, window in windows.items():
            peers = statistics.median(w.own for i, w in windows.items() if i != index)
            slow = window.own - peers > max(SHARE * step_time, FLOOR)
            self.strikes[index] = self.strikes.get(index, 0) + 1 if slow else 0
        slowest = max(windows, key=lambda i: (self.strikes[i], windows[i].own))
        if self.strikes[slowest] >= WINDOWS and self.named != slowest:
            self.named = slowest
            return slowest, windows
        if self.strikes[slowest] == 0:
            self.named = None
        return None


def _window(before: Sample, now: Sample) -> Window:
    steps, timed = now.step - before.step, now.timed - before.timed
    return Window(
        (before.step + 1, now.step),
        (now.data - before.data) / steps,
        (now.total - before.total) / steps,
        (now.compute - before.compute) / timed if timed > 0 else 0.0,
        (now.collective - before.collective) / timed if timed > 0 else 0.0,
    )


def summary(windows: Mapping[int, Window]) -> dict[str, float]:
    """Each process's newest window for a logged row, in ms, and the spread.

    ``data_ms/<process>`` (data wait per step), where steps were timed
    ``compute_ms/<process>`` and ``collective_ms/<process>`` (per timed
    step), ``step_ms`` (the median step time) and, for several processes,
    ``spread_ms`` (the largest own time, data plus compute, less the
    smallest); empty before any window.
    """
    if not windows:
        return {}
    ordered = sorted(windows.items())
    row = {f"data_ms/{i}": 1e3 * w.data for i, w in ordered}
    if any(w.compute or w.collective for _, w in ordered):
        row |= {f"compute_ms/{i}": 1e3 * w.compute for i, w in ordered}
        row |= {f"collective_ms/{i}": 1e3 * w.collective for i, w in ordered}
    if len(ordered) > 1:
        own = [w.own for _, w in ordered]
        row["spread_ms"] = 1e3 * (max(own) - min(own))
    return {**row, "step_ms": 1e3 * statistics.median(w.step_time for w in windows.values())}


def report(index: int, who: str, windows: Mapping[int, Window]) -> str:
    """The line that names the slow process, with how much and where."""
    window = windows[index]
    others = [w for i, w in windows.items() if i != index]
    data, compute = (statistics.median(getattr(w, f) for w in others) for f in ("data", "compute"))
    step_time = statistics.median(w.step_time for w in windows.values())
    first, last = window.steps
    where = f"waited {1e3 * window.data:.1f} ms per step for its data"
    peers = f"its peers {1e3 * data:.1f} ms"
    if window.compute or compute:
        where += f" and computed {1e3 * window.compute:.1f} ms before the first collective"
        peers += f" and {1e3 * compute:.1f} ms"
    look = (
        "its data loading (disk, CPU, a shared host)"
        if window.data - data >= window.compute - compute
        else "its device and its step (a slower or throttled device, work only it does)"
    )
    return (
        f"{who} sets the job's pace: it {where} in steps {first}-{last}, {peers}, of "
        f"{1e3 * step_time:.1f} ms per step ({WINDOWS} logged windows in a row): "
        f"{100 * (window.own - statistics.median(w.own for w in others)) / step_time:.0f}% of "
        "every step goes to waiting "
        f"for it. Look at {look}."
    )

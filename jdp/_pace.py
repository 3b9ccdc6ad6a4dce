"""Who sets the pace: a process that stays slower than its peers, named while the job runs.

In a synchronous job every process waits for the slowest at the next
collective, so every process's step takes the same time and step times name
no one. What differs is where each process waits: the slow one waits for its
own data (or computes), the others wait for it inside the step. ``jdp.fit``
charges each process's time to its ledger (:mod:`jdp._ledger`); at every
logged step each process publishes its ledger in JAX's key-value store (no
collective, nothing the device waits for), and process 0 compares the
windows between them.

The rule: over a window, a process's data wait per step exceeds the median
of its peers' by more than ``SHARE`` of the step time (and ``FLOOR``
seconds) in ``WINDOWS`` windows in a row. Comparing processes within the
same window cancels what the whole machine does (a noisy neighbour slows
everyone alike); requiring consecutive windows keeps one hiccup from being
named.
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
    """One process's ledger at one logged step: seconds waiting for data, seconds in all."""

    step: int
    data: float
    total: float

    def encode(self) -> str:
        return json.dumps(dataclasses.astuple(self))

    @classmethod
    def decode(cls, text: str) -> "Sample | None":
        try:
            step, data, total = json.loads(text)
            return cls(int(step), float(data), float(total))
        except (ValueError, TypeError):
            return None


@dataclasses.dataclass(frozen=True)
class Window:
    """What one process did between two of its samples, per step."""

    steps: tuple[int, int]
    data: float
    step_time: float


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
            peers = statistics.median(w.data for i, w in windows.items() if i != index)
            slow = window.data - peers > max(SHARE * step_time, FLOOR)
            self.strikes[index] = self.strikes.get(index, 0) + 1 if slow else 0
        slowest = max(windows, key=lambda i: (self.strikes[i], windows[i].data))
        if self.strikes[slowest] >= WINDOWS and self.named != slowest:
            self.named = slowest
            return slowest, windows
        if self.strikes[slowest] == 0:
            self.named = None
        return None


def _window(before: Sample, now: Sample) -> Window:
    steps = now.step - before.step
    return Window(
        (before.step + 1, now.step),
        (now.data - before.data) / steps,
        (now.total - before.total) / steps,
    )


def summary(windows: Mapping[int, Window]) -> dict[str, float]:
    """Each process's newest window for a logged row: data wait per step (ms) and the spread.

    ``data_ms/<process>``, ``spread_ms`` (the largest data wait less the
    smallest) and ``step_ms`` (the median step time); empty before two
    processes have a window.
    """
    if len(windows) < 2:
        return {}
    waits = {f"data_ms/{i}": 1e3 * w.data for i, w in sorted(windows.items())}
    return {
        **waits,
        "spread_ms": max(waits.values()) - min(waits.values()),
        "step_ms": 1e3 * statistics.median(w.step_time for w in windows.values()),
    }


def report(index: int, who: str, windows: Mapping[int, Window]) -> str:
    """The line that names the slow process, with how much."""
    window = windows[index]
    peers = statistics.median(w.data for i, w in windows.items() if i != index)
    step_time = statistics.median(w.step_time for w in windows.values())
    first, last = window.steps
    return (
        f"{who} sets the job's pace: it waited {1e3 * window.data:.1f} ms per step for its "
        f"data in steps {first}-{last}, its peers {1e3 * peers:.1f} ms, of "
        f"{1e3 * step_time:.1f} ms per step ({WINDOWS} logged windows in a row): "
        f"{100 * (window.data - peers) / step_time:.0f}% of every step goes to waiting for it. "
        "Look at its data loading (disk, CPU, a shared host)."
    )

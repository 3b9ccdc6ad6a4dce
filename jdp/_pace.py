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
step plus its compute per timed step), or either part alone, exceeds the
median of its peers' by more than ``SHARE`` of the step time (and ``FLOOR``
seconds) in ``WINDOWS`` windows in a row. Comparing processes within the
same window cancels what the whole machine does (a noisy neighbour slows
everyone alike); requiring consecutive windows keeps one hiccup from being
named.

The windows compared are the same steps on every process. Each process
publishes its newest ``KEEP`` samples, and process 0 compares, window by
window, the logged steps every process has reached. A peer's newest sample
is often one logged step behind process 0's when process 0 reads it (the
processes publish on their own threads' time). Holding that peer's steps
11-30 against process 0's 21-30 paired windows of different steps in 9 of
14 comparisons of three jobs whose process computed 10% longer, and the
rule named it within 50 steps of the slowdown in one of the three.
"""

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence

SHARE = 0.05  # of the step time: a process slower by 10% is named, by 5% not reliably
FLOOR = 2e-3  # seconds per step: below this, a wait is timer and scheduler noise
WINDOWS = 3  # consecutive windows (logged steps) before a process is named
KEEP = 4  # samples each process publishes, newest last: the steps process 0 may align on


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

    @classmethod
    def of(cls, row: object) -> "Sample | None":
        """The sample a published row holds, or None for a row of another form."""
        if not isinstance(row, list) or len(row) != 6:
            return None
        try:
            numbers = [float(x) for x in row]
        except (ValueError, TypeError):
            return None
        step, data, total, compute, collective, timed = numbers
        return cls(int(step), data, total, compute, collective, int(timed))


def encode(samples: Sequence[Sample]) -> str:
    """What a process publishes: its newest samples, oldest first."""
    return json.dumps([dataclasses.astuple(s) for s in samples])


def decode(text: str) -> list[Sample]:
    """The samples :func:`encode` wrote; rows of another form are left out."""
    try:
        rows = json.loads(text)
    except ValueError:
        return []
    samples = [Sample.of(row) for row in rows] if isinstance(rows, list) else []
    return [s for s in samples if s is not None]


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
    """Process 0's view: each process's samples since the last step compared, and its strikes."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[int, Sample]] = {}  # by process, then by step
        self.compared: int | None = None  # the newest step compared, reached by every process
        self.strikes: dict[int, int] = {}
        self.named: int | None = None
        self.windows: dict[int, Window] = {}  # each process's newest window

    def observe(
        self, published: Mapping[int, Sequence[Sample]]
    ) -> tuple[int, dict[int, Window]] | None:
        """Takes what each process published; ``(process, windows)`` when one is newly named.

        Compares, window by window, the logged steps every process has
        reached since the last one compared: the same steps on each.
        """
        for index, samples in published.items():
            seen = self.seen.setdefault(index, {})
            seen.update((s.step, s) for s in samples if s.step >= (self.compared or 0))
        reached = set.intersection(*(set(seen) for seen in self.seen.values()))
        named = None
        for step in sorted(s for s in reached if self.compared is None or s > self.compared):
            before, self.compared = self.compared, step
            windows = {
                index: _window(seen[before], seen[step])
                for index, seen in self.seen.items()
                if before is not None and before in seen
            }
            self.windows.update(windows)
            if len(windows) > 1:
                named = self._judge(windows) or named
        newest = self.compared or 0
        self.seen = {
            i: {s: x for s, x in seen.items() if s >= newest} for i, seen in self.seen.items()
        }
        return named

    def _judge(self, windows: dict[int, Window]) -> tuple[int, dict[int, Window]] | None:
        """Counts each process's strikes over ``windows``; the newly named one, if any."""
        step_time = statistics.median(w.step_time for w in windows.values())
        for index, window in windows.items():
            slow = any(
                time(window) - statistics.median(time(w) for i, w in windows.items() if i != index)
                > max(SHARE * step_time, FLOOR)
                for time in _OWN_TIMES
            )
            self.strikes[index] = self.strikes.get(index, 0) + 1 if slow else 0
        slowest = max(windows, key=lambda i: (self.strikes[i], windows[i].own))
        if self.strikes[slowest] >= WINDOWS and self.named != slowest:
            self.named = slowest
            return slowest, windows
        if self.strikes[slowest] == 0:
            self.named = None
        return None


# Each compared alone as well as together: a peer's data wait (on a timed
# step, often its host callbacks holding the interpreter) hid in the sum
# the compute of a process slowed 10% in its loss, named up to two windows
# later (steps 71-80 and 61-70 against 51-60 in two of three jobs).
_OWN_TIMES = (
    lambda w: w.own,
    lambda w: w.data,
    lambda w: w.compute,
)


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

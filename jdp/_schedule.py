"""Which of a step's periodic checks a call runs, chosen on the host.

A check that runs every ``k`` steps (``jdp.Audit(every=k)``, exact mode's
``recompute_every=k``) can decide in the graph whether a step is one of its
steps, but on XLA:CPU the branch and the collectives that keep every replica
on the same side of it cost every step, checked or not
(``benchmarks/audit.py``). A backend that knows the step number on the host
instead compiles the step once per set of due checks (:func:`scheduled`:
the checks read :func:`due` while the step is traced) and calls the one
this step needs, so the steps in between run none of it.

The host knows the number without waiting for the device: a step returns a
state whose counter is one past the counter it was given, so
:data:`COUNTS` remembers the counters it saw returned; only a state from
elsewhere (restored, replicated) is read from its device, once. Every
process reads the same number unless a fault hit the step counter of some
replicas only; then the processes would run different compilations, and the
job ends at the watchdog's deadline (a process waiting inside a collective).
"""

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_DUE: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("_DUE", default=None)


def due(check: str) -> bool | None:
    """While a step is traced: whether ``check`` runs in it; None where the graph decides."""
    chosen = _DUE.get()
    return None if chosen is None else check in chosen


def scheduled(fn: Callable[..., Any], checks: frozenset[str]) -> Callable[..., Any]:
    """``fn``, traced with exactly ``checks`` due and every other periodic check left out."""

    # A new function object: jax.pmap caches its compilations by the function.
    def traced(*args: Any) -> Any:
        token = _DUE.set(checks)
        try:
            return fn(*args)
        finally:
            _DUE.reset(token)

    return traced


def due_checks(periods: dict[str, int], step: int) -> frozenset[str]:
    """The checks whose period divides ``step`` (the state's counter after the call)."""
    return frozenset(name for name, every in periods.items() if step % every == 0)


class Counts:
    """The step counters of the last few states steps returned, with their values."""

    def __init__(self, keep: int = 4):
        self._keep = keep  # a few: fit alternates a step and its timed twin
        self._known: list[tuple[jax.Array, int]] = []

    def value(self, counter: Any) -> int | None:
        """``counter``'s value: remembered, or read from its first device; None if unreadable."""
        for array, value in self._known:
            if array is counter:
                return value
        if not isinstance(counter, jax.Array) or counter.is_deleted():
            return None
        value = int(np.asarray(counter.addressable_shards[0].data).reshape(-1)[0])
        self.returned(counter, value)
        return value

    def returned(self, counter: Any, value: int) -> None:
        """``counter`` (a step returned it, or it was read) holds ``value``."""
        self._known = [(counter, value), *self._known[: self._keep - 1]]


COUNTS = Counts()

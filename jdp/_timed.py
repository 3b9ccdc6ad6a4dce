"""``jdp.fit``'s timed steps: every ``time_every`` steps, the step's twin that stamps its phases.

The twin is the same step compiled once more with :class:`jdp._stamps.Clock`
stamps (``Backend.with_step``), so the steps in between run the step as it
was given, with nothing added. Which steps are timed depends only on the
step number, so every process times the same ones, and a resumed run the
same ones as the run it continues.
"""

import dataclasses
from typing import Any

import jax

from jdp import _phases
from jdp._args import check_int
from jdp._pace import Pace, Sample, summary
from jdp._stamps import Clock
from jdp._tree import PyTree
from jdp.backends import Backend


class Timed:
    """The timed twin of ``runner`` and the device times of its calls so far on this process."""

    def __init__(self, runner: Any, every: int):
        step = runner.step
        # A new function: jax.pmap caches its compilations by the function,
        # and would run the plain step's, without stamps.
        self.runner = runner.with_step(dataclasses.replace(step, fn=lambda s, b: step.fn(s, b)))
        self.every = every
        self.clock = Clock()
        devices = runner._replica_devices()
        here = jax.process_index()
        self.replicas = [i for i, d in enumerate(devices) if d.process_index == here]
        self.compiled = False
        self.compute = self.collective = 0.0
        self.count = 0
        self.pace = Pace()  # in one process, its own windows

    def due(self, step: int) -> bool:
        """Whether the call that makes ``step`` is timed."""
        return step % self.every == 0

    def __call__(self, run: Any, state: PyTree, batch: PyTree) -> Any:
        """``run(state, batch, twin)``, with the twin's phases stamped."""
        with _phases.observing(self.clock):
            out = run(state, batch, self.runner)
        self.compiled = True
        return out

    def totals(self) -> tuple[float, float, int]:
        """Seconds computing and in the first collective, over the timed steps the device finished."""
        for timing in self.clock.take(self.replicas):
            self.compute += timing.compute
            self.collective += timing.collective
            self.count += 1
        return self.compute, self.collective, self.count

    def alone(self, step: int, seconds: dict[str, float]) -> dict[str, float]:
        """In one process, the row's ``pace``: its newest window (:func:`jdp._pace.summary`)."""
        sample = Sample(step, seconds["data"], sum(seconds.values()), *self.totals())
        self.pace.observe({0: [sample]})
        return summary(self.pace.windows)


def timed(runner: Any, time_every: int) -> Timed | None:
    """The twin ``fit`` calls every ``time_every`` steps, or None (``time_every=0``)."""
    check_int(time_every, "time_every", minimum=0, where="jdp.fit")
    if time_every == 0:
        return None
    if not isinstance(runner, Backend):
        raise TypeError(
            f"jdp.fit: time_every={time_every} times a step wrapped by a jdp backend "
            f"(jdp.shard_map, jdp.pmap), got {type(runner).__name__}; pass time_every=0."
        )
    if runner.name == "pmap" and jax.process_count() == 1:
        raise ValueError(
            f"jdp.fit: time_every={time_every} times steps on jdp.shard_map, or on jdp.pmap across "
            "processes; in one process jdp.pmap's layout cannot hold the device's stamps. Wrap "
            "the step with jdp.shard_map, or pass time_every=0."
        )
    if not runner.host_callbacks:
        raise ValueError(
            f"jdp.fit: time_every={time_every} stamps the step with host callbacks, which JAX "
            "runs only where the step is mapped over every mesh axis, and this step's mesh has "
            "model axes; pass time_every=0 on it."
        )
    return Timed(runner, time_every)

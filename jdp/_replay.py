"""Replaying a step on two configurations, phase by phase (:func:`jdp.verify.replay`)."""

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jdp import _layout, _phases
from jdp._replication import replica_rows
from jdp._state import TrainState
from jdp._steps import TrainStep
from jdp._tree import PyTree
from jdp.metrics import host_fingerprints

AFTER = "after the update"


@dataclasses.dataclass(frozen=True)
class PhaseDifference:
    """Where a replayed step first differs between two steps.

    Attributes:
      step: the step that differs (``state.step`` after it).
      phase: the first phase whose output differs: ``"forward/backward"``
        (every replica's gradients, loss, model state and aux before any
        collective; in exact mode each virtual replica's), ``"reduction"``
        (the reduced gradients, loss and model state), ``"update"`` (the new
        state), or ``"after the update"`` (the state the step returned,
        though its update agreed: changed by a wrapper around the step, or
        in memory).
      leaves: the leaves that differ in that phase, in tree order.
      replicas: ``(run, replica)`` pairs, run ``"a"`` or ``"b"``, whose value
        of the first differing leaf differs from most of its own run's
        replicas (a fault on one device); empty where each run's replicas
        agree, and for ``"forward/backward"``, which sums over replicas.
    """

    step: int
    phase: str
    leaves: tuple[str, ...]
    replicas: tuple[tuple[str, int], ...]


def check_runner(step: Any, name: str) -> None:
    """``step`` is a backend running a step built by ``jdp.make_train_step``."""
    inner = getattr(step, "step", None)
    if not (hasattr(step, "with_step") and isinstance(inner, TrainStep)):
        raise TypeError(
            f"jdp.verify.replay: {name} must be a training step wrapped by a backend, e.g. "
            f"jdp.shard_map(jdp.make_train_step(loss_fn, ...)), got {step!r:.80}."
        )
    if not step.host_callbacks:
        raise ValueError(
            f"jdp.verify.replay: {name} runs on a mesh with model axes, where JAX runs no host "
            "callback, and the replay sends each phase's fingerprints to the host; replay it "
            "on a 1-D mesh of as many replicas (a checkpoint restores there)."
        )


def run_observed(step: Any, state: TrainState, batch: PyTree, record: _phases.Record):
    """One call of ``step`` traced with its phases sent to ``record``: ``(state, phases)``."""
    with _phases.observing(record):
        state, _ = step(state, step.shard(batch))
    jax.block_until_ready(state)
    jax.effects_barrier()  # every callback of this call has reached the record
    return state, record.take()


def phase_difference(
    step: int, seen: Sequence[dict], records: Sequence[_phases.Record]
) -> PhaseDifference | None:
    """The first of the step's phases whose fingerprints differ between the two runs."""
    for phase in _phases.PHASES:
        rows = [s.get(phase) for s in seen]
        if rows[0] is None and rows[1] is None:
            continue
        names = [r.names.get(phase, []) for r in records]
        if rows[0] is None or rows[1] is None or len(names[0]) != len(names[1]):
            raise ValueError(
                f"jdp.verify.replay: the two steps' {phase} phases hold different leaves "
                f"({len(names[0])} against {len(names[1])}); replay compares two configurations "
                "of one model and optimizer (device counts, backends, strategies, versions)."
            )
        found = _differing(phase, rows[0], rows[1])
        if found is not None:
            leaves, replicas = found
            return PhaseDifference(step, phase, tuple(names[0][i] for i in leaves), replicas)
    return None


def _differing(phase: str, a: dict[int, np.ndarray], b: dict[int, np.ndarray]):
    """``(leaf indices, replicas)`` where the runs' rows differ, or None."""
    if phase == _phases.FORWARD:  # summed over replicas and micro-batches: layout-free
        total_a, total_b = (sum(rows.values(), np.uint32(0)) for rows in (a, b))
        changed = np.flatnonzero(np.any(total_a != total_b, axis=-1))
        return None if changed.size == 0 else (changed.tolist(), ())
    reference = a[min(a)]
    tables = {"a": a, "b": b}
    differ = sorted(
        {
            int(i)
            for t in tables.values()
            for rows in t.values()
            for i in _rows_differing(rows, reference)
        }
    )
    if not differ:
        return None
    first = differ[0]
    replicas = tuple(
        (run, r)
        for run, table in tables.items()
        for r in _odd({r: rows[first].tobytes() for r, rows in table.items()})
    )
    return differ, replicas


def _rows_differing(rows: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.any(rows != reference, axis=-1))


def _odd(values: dict[int, bytes]) -> list[int]:
    """The replicas whose value differs from most of their run's (replica 0's on a tie)."""
    counts = collections.Counter(values.values())
    top = max(counts.values())
    first = min(values)
    common = values[first] if counts[values[first]] == top else counts.most_common(1)[0][0]
    return sorted(r for r, v in values.items() if v != common)


def after_difference(
    step: int, runners: Sequence[Any], states: Sequence[Any]
) -> PhaseDifference | None:
    """Whether the returned states differ though the update agreed: logically, or between replicas."""
    tables = [_after_rows(runner, state) for runner, state in zip(runners, states, strict=True)]
    (names, logical_a, odd_a), (_, logical_b, odd_b) = tables
    differ = [i for i, (x, y) in enumerate(zip(logical_a, logical_b, strict=True)) if x != y]
    odd = sorted({*(("a", r, i) for r, i in odd_a), *(("b", r, i) for r, i in odd_b)})
    if not differ and not odd:
        return None
    leaves = sorted(set(differ) | {i for *_, i in odd})
    replicas = tuple((run, r) for run, r, i in odd if i == leaves[0])
    return PhaseDifference(step, AFTER, tuple(names[i] for i in leaves), replicas)


def _after_rows(runner: Any, state: PyTree):
    """``(leaf names, logical per-leaf fingerprints, (replica, leaf) pairs out of sync)``."""
    logical = runner.unreplicate(state)
    paths = jax.tree_util.tree_flatten_with_path(logical)[0]
    names = [jax.tree_util.keystr(path) for path, _ in paths]
    _, rows = host_fingerprints(logical)
    odd: list[tuple[int, int]] = []
    shared = jax.tree.leaves(_layout.shared(state), is_leaf=lambda x: x is None)
    for i, leaf in enumerate(shared):
        if leaf is None:  # a strategy's per-replica slices differ by design
            continue
        copies = dict(enumerate(copy.tobytes() for copy in replica_rows(leaf)))
        odd.extend((r, i) for r in _odd(copies))
    return names, rows, odd

"""Metrics as values: what a step logs, and how replicas' values become one.

A :class:`Metric` carries its name, how a step computes it (from a
:class:`StepView`), and its :data:`Rule`: how the per-replica values of one
logged step combine into the value ``jdp.fit`` records. A step carries the
rule of every metric it returns (``TrainStep.metric_rules``), so the loop
reads rules from the step and looks up no names.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp._state import TrainState
from jdp._tree import PyTree

Rule = Callable[[np.ndarray, np.ndarray | None], Any]
"""``(per-replica values (n, ...), per-replica weights (n,) or None) -> logged value``."""


def _value(x: np.ndarray) -> Any:
    return float(x) if np.ndim(x) == 0 else np.asarray(x).tolist()


def mean(values: np.ndarray, weights: np.ndarray | None) -> Any:
    """The plain mean over replicas (element by element for vector metrics)."""
    del weights
    return _value(np.asarray(values, np.float64).mean(axis=0))


def weighted_mean(values: np.ndarray, weights: np.ndarray | None) -> Any:
    """The mean over replicas weighted by the step's weights (a WeightedLoss's); else the mean.

    Every replica's value weighs its share of the global weight, so the
    logged loss is the global objective ``sum(totals) / sum(weights)``.
    """
    values = np.asarray(values, np.float64)
    if weights is None or values.shape[:1] != np.shape(weights):
        return mean(values, None)
    w = np.asarray(weights, np.float64).reshape((-1,) + (1,) * (values.ndim - 1))
    total = float(w.sum())
    return _value((values * w).sum(axis=0) / total) if total > 0 else _value(values[0] * 0.0)


def total(values: np.ndarray, weights: np.ndarray | None) -> Any:
    """The sum over replicas (e.g. the step's global weight)."""
    del weights
    return _value(np.asarray(values, np.float64).sum(axis=0))


def same(values: np.ndarray, weights: np.ndarray | None) -> Any:
    """A value every replica computes alike (a global norm, the loss scale): replica 0's."""
    del weights
    return _value(np.asarray(values, np.float64)[0])


def exact_int(values: np.ndarray, weights: np.ndarray | None) -> Any:
    """An integer every replica holds alike (a counter, a fingerprint): replica 0's, exactly."""
    del weights
    first = np.asarray(values)[0]
    return int(first) if np.ndim(first) == 0 else first.tolist()


class StepView(NamedTuple):
    """What a metric sees inside a training step.

    Attributes:
      before: the step's input state.
      after: its output state.
      grads: the reduced, unscaled gradients, as the strategy holds them.
      global_norm: ``(grads) -> norm`` of gradients held as the strategy holds them.
      axis_name: the data axis.
    """

    before: TrainState
    after: TrainState
    grads: PyTree
    global_norm: Callable[[PyTree], jax.Array]
    axis_name: str


class Metric(NamedTuple):
    """A metric a training step computes: ``make_train_step(..., metrics=(...))``.

    Attributes:
      name: its key in the step's metrics.
      compute: ``(view: StepView) -> array``, inside the step.
      rule: how replicas' values combine when the loop logs it.
    """

    name: str
    compute: Callable[[StepView], jax.Array]
    rule: Rule = same


def rule_of(rules: Mapping[str, Rule], name: str) -> Rule:
    """The rule of metric ``name``; a step's own aux metrics weigh by the step's weight."""
    return rules.get(name, weighted_mean)

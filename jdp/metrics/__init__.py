"""Metrics as values: each carries how a step computes it and how replicas combine.

Pass them to :func:`jdp.make_train_step` as ``metrics=``; ``jdp.fit`` logs
each by its own rule. A new metric is one :class:`Metric` value::

    param_norm = jdp.metrics.Metric(
        "param_norm", lambda view: optax.tree.norm(view.after.params), jdp.metrics.same)
"""

from jdp.metrics._base import (
    Metric,
    Rule,
    StepView,
    exact_int,
    mean,
    rule_of,
    same,
    total,
    weighted_mean,
)
from jdp.metrics._builtin import grad_norm, learning_rate
from jdp.metrics._fingerprint import (
    fingerprint,
    host_fingerprints,
    leaf_fingerprints,
    replicas_agree,
    state_fingerprint,
)

__all__ = [
    "Metric",
    "Rule",
    "StepView",
    "exact_int",
    "fingerprint",
    "grad_norm",
    "host_fingerprints",
    "leaf_fingerprints",
    "learning_rate",
    "mean",
    "replicas_agree",
    "rule_of",
    "same",
    "state_fingerprint",
    "total",
    "weighted_mean",
]

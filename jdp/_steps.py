"""Steps as typed values: the per-replica function and what a backend needs to run it.

A :class:`TrainStep` carries its function, its data axis and its strategy;
an :class:`EvalStep` its function and axis. Both are frozen values, so a
user's wrapper keeps them with :func:`wraps` (as ``functools.wraps`` keeps a
function's name). Backends turn anything else (a plain function) into a
``TrainStep`` with the default strategy, in one place: :func:`as_step`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import jax

from jdp._audit import Audit
from jdp._batching import AXIS_NAME
from jdp._layout import Placement
from jdp._state import TrainState
from jdp._tree import PyTree
from jdp.metrics import Rule
from jdp.strategies import Strategy, data_parallel

Metrics = dict[str, jax.Array]
StepFn = Callable[[Any, PyTree], Any]


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A per-replica training step ``(state, batch) -> (state, metrics)``.

    Built by :func:`jdp.make_train_step`; call it inside a backend. Its
    settings (``axis_name``, ``strategy``) travel with it: a wrapper that
    adds work around it keeps them with ``@jdp.wraps(step)``.

    Attributes:
      fn: the per-replica function.
      axis_name: the data axis it reduces over.
      strategy: how gradients cross replicas and where the state lives.
      metric_rules: ``(name, rule)`` for each metric it returns
        (:mod:`jdp.metrics`): how ``jdp.fit`` combines replicas' values.
        Metrics without a rule (a wrapper's own) weigh by the step's weight.
      audit: the replica-agreement check the backend runs (:class:`jdp.Audit`), or None.
    """

    fn: StepFn
    axis_name: str = AXIS_NAME
    strategy: Strategy = dataclasses.field(default_factory=data_parallel)
    metric_rules: tuple[tuple[str, Rule], ...] = ()
    audit: Audit | None = None
    returns_state: ClassVar[bool] = True

    def __call__(self, state: Any, batch: PyTree) -> Any:
        return self.fn(state, batch)

    def place(self, tree: PyTree, placement: Placement) -> PyTree:
        """A host tree on the devices: a TrainState as the strategy places it."""
        if isinstance(tree, TrainState):
            return self.strategy.place(tree, placement)
        return placement.replicate(tree)

    @property
    def compiler_options(self) -> dict[str, str | bool] | None:
        """The XLA options the strategy needs the step compiled with, or None."""
        return dict(self.strategy.compiler_options) or None

    @property
    def checks(self) -> dict[str, int]:
        """``{name: every}``: the checks it runs every ``every`` steps (the audit, the strategy's)."""
        audit = {} if self.audit is None else {"audit": self.audit.every}
        return {**audit, **dict(self.strategy.checks)}


@dataclasses.dataclass(frozen=True)
class EvalStep:
    """A per-replica evaluation step ``(state, batch) -> sums`` (it returns no state).

    Built by :func:`jdp.make_eval_step`. Backends never donate its state.

    Attributes:
      fn: the per-replica function.
      axis_name: the data axis it sums over.
      strategy: the training step's strategy: it places the state and gives
        the evaluation forward the whole parameters.
    """

    fn: StepFn
    axis_name: str = AXIS_NAME
    strategy: Strategy = dataclasses.field(default_factory=data_parallel)
    returns_state: ClassVar[bool] = False

    def __call__(self, state: Any, batch: PyTree) -> Any:
        return self.fn(state, batch)

    def place(self, tree: PyTree, placement: Placement) -> PyTree:
        """A host tree on the devices: a TrainState as the strategy places it."""
        if isinstance(tree, TrainState):
            return self.strategy.place(tree, placement)
        return placement.replicate(tree)

    compiler_options: ClassVar[None] = None


PerReplicaStep = TrainStep | EvalStep
"""What a backend runs (``jdp.pmap``, ``jdp.shard_map``)."""

S = TypeVar("S", TrainStep, EvalStep)


def wraps(step: S) -> Callable[[StepFn], S]:
    """Decorates a wrapper of ``step`` so that it keeps ``step``'s settings.

    A plain function around a step (an EMA update, an extra metric) hides the
    step's axis and strategy from the backend; decorated, the wrapper is a
    step of the same kind and settings that runs the wrapper's body.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jdp
      >>> base = jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2),
      ...                            strategy=jdp.strategies.zero1())
      >>> @jdp.wraps(base)
      ... def with_norm(state, batch):
      ...     state, metrics = base(state, batch)
      ...     return state, {**metrics, "param_norm": jnp.linalg.norm(state.params)}
      >>> step = jdp.pmap(with_norm)
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(8), tx=optax.adam(0.1)))
      >>> state, metrics = step(state, step.shard(np.ones((16, 8), np.float32)))
      >>> sorted(metrics)
      ['loss', 'param_norm']
    """
    if not isinstance(step, (TrainStep, EvalStep)):
        raise TypeError(
            "jdp.wraps takes a step built by jdp.make_train_step or jdp.make_eval_step, got "
            f"{type(step).__name__}."
        )

    def decorate(fn: StepFn) -> S:
        if not callable(fn):
            raise TypeError(f"jdp.wraps: the wrapper must be callable, got {fn!r}.")
        return dataclasses.replace(step, fn=fn)

    return decorate


def as_step(step: Any, backend: str, axis_name: str) -> TrainStep | EvalStep:
    """The step a backend runs: a jdp step as it is, a plain function as a TrainStep.

    A plain function gets the default strategy and the backend's axis.
    """
    if isinstance(step, (TrainStep, EvalStep)):
        return step
    if all(hasattr(step, name) for name in ("step", "shard", "replicate")):
        raise TypeError(
            f"jdp.{backend} got a step that is already wrapped by a backend "
            f"({type(step).__name__}); pass the per-replica step itself: "
            f"jdp.{backend}(jdp.make_train_step(...)), once."
        )
    if not callable(step):
        raise TypeError(
            f"jdp.{backend} takes a per-replica step (jdp.make_train_step(...)), got {step!r}."
        )
    return TrainStep(step, axis_name)

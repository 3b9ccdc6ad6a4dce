"""What every backend does around its compiled step: one lifecycle.

A backend is a :class:`Backend` subclass that says how to compile the mapped
step (``_compile``), which :mod:`jdp._layout` layout it holds a state in, how
it places a state and a batch, and how to check its inputs at trace time.
Everything else is here: turning a plain function into a step, the axis and
donation checks, the option-less twin for an outer ``jax.jit``, the guard
against donated buffers, jdp's own errors, and re-placing a state that
arrives in the other backend's layout.
"""

import abc
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, overload

import jax

from jdp import _layout, _schedule, _watchdog
from jdp._audit import Checker
from jdp._batching import leaves_with_paths
from jdp._devices import warn_if_cpu_pool_unsafe
from jdp._replication import CONSUMED, check_replicas_agree, refuse_consumed, unreplicate
from jdp._steps import EvalStep, PerReplicaStep, TrainStep, as_step
from jdp._tree import PyTree
from jdp.distributed import check_initialized

K = TypeVar("K", TrainStep, EvalStep)  # the kind of step a backend runs
T = TypeVar("T")  # the user's state type: a step returns the type it was given
Step = TrainStep | EvalStep | Callable[[Any, PyTree], Any]
Compiled = Callable[[PyTree, PyTree], Any]
Metrics = dict[str, jax.Array]


class Runner(Protocol):
    """A step wrapped by a backend: what :func:`jdp.fit` and :func:`jdp.evaluate` use."""

    @property
    def step(self) -> PerReplicaStep: ...

    def __call__(self, state: Any, batch: PyTree) -> Any: ...

    def replicate(self, tree: Any) -> Any: ...

    def unreplicate(self, tree: Any) -> Any: ...

    def shard(self, batch: PyTree) -> PyTree: ...

    def with_step(self, step: Any) -> "Runner": ...


class Backend(abc.ABC, Generic[K]):
    """The shared part of :class:`jdp.backends.PmapStep` and :class:`jdp.backends.ShardMapStep`.

    Attributes:
      step: the per-replica step it runs.
      axis_name: the data axis it binds.
      layout: how it holds a replicated state (:data:`jdp._layout.LEADING_AXIS`
        or :data:`jdp._layout.MESH_REPLICATED`).
    """

    name: str = "backend"
    layout: _layout.Layout
    _per_call_checks: bool = False  # whether _check_call checks anything on every call
    recycles: bool = False  # whether call_into writes the new state into a spare's buffers
    # Whether the mapped step can call the host (jax.debug.callback,
    # io_callback): JAX runs callbacks only where every mesh axis is mapped.
    host_callbacks: bool = True

    def _setup(self, step: Step, axis_name: str, donate_state: bool | None, size: int) -> None:
        step = as_step(step, self.name, axis_name)
        _check_axis_name(step, axis_name, self.name)
        check_initialized()
        self.step: K = step  # type: ignore[assignment]
        self.axis_name = axis_name
        self._donate = _donation(step, donate_state, self.name)
        self._has_options = step.compiler_options is not None
        # Reusing donated buffers crashes multi-device executions on XLA:CPU
        # (JAX 0.10.2: segfault); one device raises, and _explain names it.
        self._guard_donated = bool(self._donate) and size > 1
        self._replicas_checked = False
        self._lean = False  # after the first call, when nothing is left to check per call
        self._audit = _checker(step, self.name, self._replica_devices())
        self._twins: dict[frozenset[str], Backend[K]] = {}  # by the checks they run
        self._called = False  # as a twin: whether a call ran it (compiled it)
        warn_if_cpu_pool_unsafe(size)

    @property
    def donates_state(self) -> bool:
        """Whether a call consumes its input state (``donate_state``)."""
        return bool(self._donate)

    def _build(self) -> None:
        self._fn = self._compile(True)
        # Under an outer jit, which takes the options itself (a nested jit cannot).
        self._fn_traced = self._compile(False) if self._has_options else self._fn

    @abc.abstractmethod
    def with_step(self, step: K) -> "Backend[K]":
        """The same backend (devices, axis, donation) running another step of the same kind.

        Compiled anew on its first call. ``jdp.fit`` runs the step it is given
        through this when it adds work to it (the survivors' copy of a split
        state).

        Example:
          >>> import jax.numpy as jnp, jdp
          >>> step = jdp.pmap(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2)))
          >>> other = step.with_step(jdp.make_train_step(lambda p, b: jnp.mean(b * p)))
          >>> type(other).__name__, other.donates_state, other.step is step.step
          ('PmapStep', True, False)
        """

    def call_into(self, state: T, batch: PyTree, spare: list[jax.Array]) -> tuple[T, Metrics]:
        """Runs a step that keeps its state, writing the new state into ``spare``'s buffers.

        Only a backend that :attr:`recycles` can (``jdp.shard_map``; see
        :meth:`jdp.backends.ShardMapStep.call_into`).

        Raises:
          ValueError: here, always: this backend does not recycle.
        """
        raise ValueError(NO_CALL_INTO.format(name=self.name))

    @abc.abstractmethod
    def _replica_devices(self) -> list[jax.Device]:
        """The device of each replica, in replica order (replica i on entry i)."""

    @abc.abstractmethod
    def _compile(self, options: bool) -> Compiled:
        """The jitted mapped step, with the strategy's compiler options or without."""

    def _check_call(self, state: PyTree, batch: PyTree) -> None:
        """Checks that must run on every call (none where the trace checks)."""

    @overload
    def __call__(self: "Backend[TrainStep]", state: T, batch: PyTree) -> tuple[T, Metrics]: ...

    @overload
    def __call__(self: "Backend[EvalStep]", state: Any, batch: PyTree) -> dict[str, Any]: ...

    def __call__(self, state: Any, batch: PyTree) -> Any:
        """Runs the step: ``(state, metrics)`` for a training step, sums for an evaluation step."""
        if self._lean and _watchdog.JOB is None:
            # One process and nothing to check per call: what jax.jit costs. In a
            # dispatch-bound loop the checks below cost about 1 us a call (cold caches).
            try:
                return self._fn(state, batch)
            except (ValueError, TypeError, IndexError, NameError, RuntimeError) as e:
                return self._failed(e, state, batch)
        return self._checked_call(state, batch)

    def _checked_call(self, state: Any, batch: PyTree, spare: list[jax.Array] | None = None) -> Any:
        self._check_call(state, batch)
        if not self._replicas_checked and not _consumed(state):
            check_replicas_agree(state, f"jdp.{self.name}")
            self._replicas_checked = not _traced(state)
            self._lean = self._replicas_checked and self._nothing_per_call()
        runner, count = self._scheduled(state)
        fn = runner._fn if spare is None else runner._into(spare)
        if self._has_options and _traced(state):
            _warn_options_lost(self.step)
            fn = self._fn_traced
        _watchdog.note_step()
        if self._guard_donated and _consumed(state):
            raise RuntimeError(_CONSUMED)
        try:
            out = fn(state, batch)
        except (ValueError, TypeError, IndexError, NameError, RuntimeError) as e:
            return self._failed(e, state, batch)
        if count is not None:
            _schedule.COUNTS.returned(out[0].step, count + 1)
            runner._called = True
        if self._audit is not None:
            self._audit.note(out[1], out[0])
        if _watchdog.counts_results():  # several processes; the metrics are never donated
            result = out[1] if isinstance(self.step, TrainStep) else out
            if not _traced(result):
                _watchdog.note_result(result)
        return out

    def _scheduled(self, state: Any) -> tuple["Backend[K]", int | None]:
        """The compilation to run and the state's step count (None: unknown on the host).

        Where the step runs checks every k steps and the host knows the
        count, a twin compiled with only the checks due at this step
        (:mod:`jdp._schedule`); else this step, which decides in the graph.
        """
        periods = self.step.checks if isinstance(self.step, TrainStep) else {}
        if not periods or _traced(state):
            return self, None
        count = _schedule.COUNTS.value(getattr(state, "step", None))
        if count is None:
            return self, None
        due = _schedule.due_checks(periods, count + 1)
        twin = self._twins.get(due)
        if twin is None:
            fn = _schedule.scheduled(self.step.fn, due)
            twin = self._twins[due] = self.with_step(dataclasses.replace(self.step, fn=fn))
        return twin, count

    def compiles(self, state: Any) -> bool:
        """Whether a call with ``state`` runs a twin of the step for the first time.

        A twin with a periodic check compiles on the first step that needs
        it, not on the first call; ``jdp.fit``'s ledger counts that call's
        time as compilation.
        """
        runner, _ = self._scheduled(state)
        return runner is not self and not runner._called

    def _into(self, spare: list[jax.Array]) -> Compiled:
        """The step that writes its new state into ``spare`` (a backend that recycles)."""
        raise ValueError(NO_CALL_INTO.format(name=self.name))

    def _nothing_per_call(self) -> bool:
        return not (
            self._has_options
            or self._guard_donated
            or self._audit is not None
            or self._per_call_checks
        )

    def _failed(self, error: Exception, state: Any, batch: PyTree) -> Any:
        """A call that raised: jdp's own error, or a state in the other layout re-placed once."""
        try:
            _explain(error, state, batch, self.axis_name, self.name)
            raise error
        except ValueError:
            other = self._other_layout(state)
            if other is None:
                raise
            # A state in the other backend's layout (jdp.replicate under shard_map,
            # say) is re-placed once; the step returns it in this one's.
            return self(other, batch)

    def check_audit(self) -> None:
        """Checks the last call's replica audit now (a step built with ``audit=``, or exact
        mode's ``recompute_every``; else nothing).

        Each call checks the previous call's audit after dispatching its own
        step, so the device never waits; this checks the last one, waiting
        for it. ``jdp.fit`` calls it before every checkpoint save and at the end.

        Raises:
          jdp.ReplicaMismatchError: with ``on_mismatch="raise"`` (the default
            without ``audit=``), when the replicas disagreed after that step
            or a device's recomputed gradients differed.
        """
        if self._audit is not None:
            self._audit.check()

    def _other_layout(self, state: PyTree) -> PyTree | None:
        """``state`` re-placed in this backend's layout, if it is held in another one."""
        try:
            layout = _layout.layout_of(state)
        except (ValueError, TypeError):
            return None
        if layout is None or layout is self.layout or _consumed(state):
            return None
        return self.replicate(unreplicate(state))

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for these arguments (``.compile()``, ``.as_text()``)."""
        return self._fn.lower(state, batch)  # type: ignore[attr-defined]

    def replicate(self, tree: T) -> T:
        """``tree`` on this backend's devices; a TrainState as the step's strategy places it."""
        refuse_consumed(tree, f"jdp.{type(self).__name__}.replicate")
        return self.step.place(tree, self._placement())

    @abc.abstractmethod
    def _placement(self) -> _layout.Placement:
        """What this backend gives a strategy's ``place``: its layout on its devices."""

    def unreplicate(self, tree: T) -> T:
        """Replica 0's values; a strategy's split state whole (see :func:`jdp.unreplicate`)."""
        return unreplicate(tree)


def _checker(step: PerReplicaStep, backend: str, devices: list[jax.Device]) -> Checker | None:
    """The host half of the step's in-graph checks (``audit``, ``recompute``), or None."""
    if not isinstance(step, TrainStep):
        return None
    checks = ("audit",) * (step.audit is not None) + ("recompute",) * (
        "recompute" in dict(step.metric_rules)
    )
    policy = "raise" if step.audit is None else step.audit.on_mismatch
    return Checker(policy, backend, devices, checks) if checks else None


def _donation(step: PerReplicaStep, donate_state: bool | None, backend: str) -> tuple[int, ...]:
    """``donate_argnums``: the state, for steps that return a new one."""
    returns_state = step.returns_state
    if donate_state is None:
        donate_state = returns_state
    if not isinstance(donate_state, bool):
        raise TypeError(
            f"jdp.{backend}: donate_state must be True, False or None, got {donate_state!r}."
        )
    if donate_state and not returns_state:
        raise ValueError(
            f"jdp.{backend}(donate_state=True) on an evaluation step: it returns no state, "
            "so donating would delete the caller's state. Leave donate_state unset."
        )
    return (0,) if donate_state else ()


def _check_axis_name(step: PerReplicaStep, axis_name: str, backend: str) -> None:
    if step.axis_name != axis_name:
        raise ValueError(
            f"jdp.{backend}: the step was built with axis_name={step.axis_name!r} but jdp.{backend} "
            f"binds axis_name={axis_name!r}; pass the same name to both."
        )


def _traced(state: PyTree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state))


def _warn_options_lost(step: PerReplicaStep) -> None:
    """An outer transform (jax.jit) compiles the step: the strategy's options are that jit's to pass."""
    name = step.strategy.name if isinstance(step, TrainStep) else type(step).__name__
    warnings.warn(
        f"This jdp step's strategy ({name}) needs XLA options that jdp passes "
        "when it compiles the step, but an outer transform (jax.jit) is compiling it here; "
        "without them the result may differ by device count. Pass them to your jit (then "
        f"this warning is all that is left): jax.jit(f, compiler_options={step.compiler_options!r}).",
        stacklevel=4,
    )


def _explain(error: Exception, state: PyTree, batch: PyTree, axis_name: str, backend: str) -> None:
    """Raises jdp's own error for a call that failed, where it has one; else returns.

    A consumed state, an axis the backend does not bind, a step mapped by a
    transform, a leaf JAX cannot take. Runs only when the call failed.
    """
    if isinstance(error, NameError):
        if "unbound axis name" in str(error):
            raise NameError(
                f"jdp.{backend}: the step uses a collective over an axis jdp.{backend} does not "
                f"bind: {error}. This backend binds axis_name={axis_name!r}; use that name in "
                "lax.psum/pmean calls inside the step (and in make_train_step(axis_name=...))."
            ) from None
        return
    if _mapped_by_a_transform(error, state, batch):
        raise TypeError(
            f"jdp.{backend}: the step was called under jax.vmap or jax.pmap (or another "
            "transform that maps over the inputs): it is mapped over the devices already. "
            "Call it directly; to map the step yourself, map the per-replica step "
            "(jax.pmap(jdp.make_train_step(...), axis_name=...)); to add work inside the "
            "step, wrap it with @jdp.wraps(train_step)."
        ) from error
    # JAX 0.10 raises ValueError("... deleted or donated ..."), 0.11 RuntimeError("Array has
    # been deleted ..."): the state's own buffers decide, not the wording.
    if isinstance(error, ValueError | RuntimeError) and _consumed(state):
        raise RuntimeError(_CONSUMED) from None
    if isinstance(error, TypeError) and "Error interpreting argument" in str(error):
        # jdp's own message, naming the leaf
        leaves_with_paths(batch, f"jdp.{backend} step: the batch")
        leaves_with_paths(state, f"jdp.{backend} step: the state")


def _mapped_by_a_transform(error: Exception, *trees: PyTree) -> bool:
    """Inputs traced by a transform that maps them (vmap, pmap): they lost their leading axis.

    ``jax.jit`` around a step composes (its tracers keep their shapes); under
    ``jax.pmap`` the tracers look like jit's, so the layout error they cause tells.
    """
    tracers = [x for x in jax.tree.leaves(trees) if isinstance(x, jax.core.Tracer)]
    if any(type(x).__name__ == "BatchTracer" for x in tracers):
        return True
    layout = isinstance(error, IndexError) or any(
        phrase in str(error) for phrase in ("is not replicated", "expects a leading device axis")
    )
    return bool(tracers) and layout


NO_CALL_INTO = (
    "jdp.{name}.call_into needs a backend that recycles (recycles=True: jdp.shard_map) "
    "and a step built with donate_state=False; call the step itself."
)

_CONSUMED = "jdp: this state was consumed by an earlier step call: " + CONSUMED


def _consumed(state: PyTree) -> bool:
    return any(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
        for x in jax.tree.leaves(state)
    )

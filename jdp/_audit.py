"""Replica agreement, checked in the graph: every k steps each replica's state is hashed and compared.

In data parallelism every replica must hold bitwise the same state after
every update, so a replica that holds other bits computed (or stored)
something wrong. Every ``every`` steps the step hashes each leaf of its new
state on every replica (:func:`jdp.metrics._fingerprint.leaf_hashes`),
gathers the hashes (``leaves x 2`` words per replica: one small
collective), and finds per leaf the value most replicas hold. The step
returns ``audit``: ``[step, replica, leaf, votes]``, the same on every
replica: the first replica that differs from the majority on the first
leaf that differs, and how many replicas hold the majority's value; or
``[step, -1, -1, n]`` when all agree, ``[step, -2, -2, 0]`` on a step that
was not audited.

The backend reads a call's result at its next call, after dispatching it
(so the device never waits), or at :meth:`check_audit`; ``jdp.fit`` checks
before every checkpoint save, so no checkpoint holds a state that failed.
"""

import dataclasses
import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp import _watchdog
from jdp._args import check_int
from jdp._tree import PyTree
from jdp.metrics._base import Metric, StepView, exact_int
from jdp.metrics._fingerprint import leaf_hashes

Policy = Literal["raise", "warn", "stop"]
POLICIES = ("raise", "warn", "stop")
NOT_AUDITED, AGREED = -2, -1


class ReplicaMismatchError(RuntimeError):
    """The replicas of a data-parallel state hold different bits after a step."""


@dataclasses.dataclass(frozen=True)
class Audit:
    """Replica agreement for :func:`jdp.make_train_step`: ``audit=jdp.Audit(every=100)``.

    Attributes:
      every: audit the state after every step whose number (``state.step``
        after it) is a multiple of ``every``.
      on_mismatch: ``"raise"`` a :class:`jdp.ReplicaMismatchError`;
        ``"warn"`` (a ``RuntimeWarning``, once per replica and leaf) and go on; or ``"stop"``: end the
        job through jdp's fail-fast path (every process exits with status
        1, so ``jdp.launch --max-restarts`` or the scheduler restarts it
        from the last checkpoint, which ``jdp.fit`` saved only after its
        audit passed).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jdp
      >>> step = jdp.pmap(jdp.make_train_step(
      ...     lambda p, b: jnp.mean((b * p) ** 2), audit=jdp.Audit(every=1)))
      >>> state = step.replicate(jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1)))
      >>> state, metrics = step(state, step.shard(np.ones(16, np.float32)))
      >>> step.check_audit()  # the replicas agree: nothing raised
      >>> metrics["audit"][0].tolist()  # [step, replica, leaf, replicas in the majority]
      [1, -1, -1, 8]
    """

    every: int = 1
    on_mismatch: Policy = "raise"

    def __post_init__(self) -> None:
        check_int(self.every, "every", minimum=1, where="jdp.Audit")
        if self.on_mismatch not in POLICIES:
            raise ValueError(
                f"jdp.Audit: on_mismatch must be one of {POLICIES}, got {self.on_mismatch!r}."
            )

    def metric(self) -> Metric:
        """The in-graph half: the ``audit`` metric of the step."""
        return Metric("audit", lambda view: agreement(view, self.every), exact_int)


def agreement(view: StepView, every: int) -> jax.Array:
    """``[step, replica, leaf, votes]`` (int32) for the new state, the same on every replica."""
    # Every replica takes the same branch (one that took the other would hang
    # in its collective), whatever its own count says: that may be the bit
    # that flipped, so counts that differ are audited too.
    own = view.after.step.astype(jnp.int32)

    def audit() -> jax.Array:
        # One all-gather: each replica's leaf hashes, and its step count as a last row.
        rows = jnp.concatenate([leaf_hashes(view.after), jnp.stack([own, own])[None]])
        gathered = lax.all_gather(rows, view.axis_name)
        steps, table = gathered[:, -1, 0], gathered[:, :-1]  # (n,), (n, leaves, 2)
        step = steps[jnp.argmax(jnp.sum(steps[:, None] == steps[None, :], axis=1))]
        same = jnp.all(table[:, None] == table[None, :], axis=-1)  # (n, n, leaves)
        votes = same.sum(axis=1)  # per replica and leaf: how many hold its value
        majority = jnp.argmax(votes, axis=0)  # per leaf: a replica holding the majority's value
        odd = ~jnp.take_along_axis(same, majority[None, None, :], axis=1)[:, 0]  # (n, leaves)
        bad = jnp.any(odd, axis=0)
        leaf = jnp.where(jnp.any(bad), jnp.argmax(bad), AGREED)
        replica = jnp.where(jnp.any(bad), jnp.argmax(odd[:, jnp.maximum(leaf, 0)]), AGREED)
        held = jnp.max(votes[:, jnp.maximum(leaf, 0)])
        return jnp.stack([step, replica, leaf, held]).astype(jnp.int32)

    if every == 1:  # no branch and no gate: each costs about 1.5 ms a step on XLA:CPU
        return audit()
    high, neg_low = lax.pmax(jnp.stack([own, -own]), view.axis_name)  # one tiny all-reduce
    low = -neg_low
    skipped = jnp.stack([low, *[jnp.int32(NOT_AUDITED)] * 2, jnp.int32(0)])
    return lax.cond((low % every == 0) | (high != low), audit, lambda: skipped)


class Checker:
    """The host half, held by a backend: reads each call's ``audit`` one call late."""

    def __init__(self, audit: Audit, backend: str, devices: list[jax.Device]):
        self.audit, self.backend, self.devices = audit, backend, devices
        self._held: tuple[jax.Array, Any] | None = None
        self._warned: set[tuple[int, int]] = set()

    def note(self, metrics: Any, state: PyTree) -> None:
        """Keeps this call's result (no wait) after checking the previous call's."""
        if not isinstance(metrics, dict) or "audit" not in metrics:
            raise ValueError(
                f"jdp.{self.backend}: the step was built with audit=jdp.Audit(...) but its "
                "metrics hold no 'audit' entry: a wrapper (jdp.wraps) dropped it. Return the "
                "wrapped step's metrics with your own added: {**metrics, ...}."
            )
        previous, self._held = self._held, (metrics["audit"], jax.tree.structure(state))
        if previous is not None:
            self._check(*previous)

    def check(self) -> None:
        """Checks the last call's result now (waits for that step)."""
        held, self._held = self._held, None
        if held is not None:
            self._check(*held)

    def _check(self, result: jax.Array, treedef: Any) -> None:
        if isinstance(result, jax.core.Tracer):
            return
        # Every replica holds the same four ints: this process's first one reads them.
        first = np.asarray(result.addressable_shards[0].data).reshape(4)
        step, replica, leaf, votes = (int(v) for v in first)
        if replica < 0:
            return
        message = self._message(step, replica, leaf, votes, treedef)
        if self.audit.on_mismatch == "warn":
            # Once per replica and leaf: a replica that stays apart would warn every step.
            if (replica, leaf) not in self._warned:
                self._warned.add((replica, leaf))
                warnings.warn(message, RuntimeWarning, stacklevel=4)
        elif self.audit.on_mismatch == "stop":
            _watchdog.end_job(message)
        else:
            raise ReplicaMismatchError(message)

    def _message(self, step: int, replica: int, leaf: int, votes: int, treedef: Any) -> str:
        n = len(self.devices)
        paths, _ = jax.tree_util.tree_flatten_with_path(
            treedef.unflatten(range(treedef.num_leaves))
        )
        name = "state" + jax.tree_util.keystr(paths[leaf][0])
        device = self.devices[replica]
        where = f" (device {device}, process {device.process_index})"
        odd = (
            f"replica {replica}{where} differs from the value {votes} of the {n} replicas hold"
            if 2 * votes > n
            else f"no value is held by a majority of the {n} replicas (replica {replica}{where} "
            "is one that differs)"
        )
        return (
            f"jdp.Audit: replicas disagree after step {step}: {odd}, first at leaf {name}. A device "
            "computed or stored wrong bits (silent data corruption) or the replicas started "
            "apart. Restore the last checkpoint (jdp.fit saves only audited states) and run "
            "on, excluding that device if it repeats."
        )

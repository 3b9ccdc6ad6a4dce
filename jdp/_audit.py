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

Which steps are audited the backend chooses on the host where it knows the
step count (:mod:`jdp._schedule`): the steps in between run a compilation
without the audit. Where it cannot know (under an outer ``jax.jit``), the
step decides in the graph.

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

from jdp import _schedule, _watchdog
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

    chosen = _schedule.due("audit")
    if every == 1 or chosen:  # no branch and no gate: each costs about 1.5 ms a step on XLA:CPU
        return audit()
    if chosen is not None:  # the host chose a step without the audit: no part of it runs
        return jnp.stack([own, *[jnp.int32(NOT_AUDITED)] * 2, jnp.int32(0)])
    high, neg_low = lax.pmax(jnp.stack([own, -own]), view.axis_name)  # one tiny all-reduce
    low = -neg_low
    skipped = jnp.stack([low, *[jnp.int32(NOT_AUDITED)] * 2, jnp.int32(0)])
    return lax.cond((low % every == 0) | (high != low), audit, lambda: skipped)


class Checker:
    """The host half, held by a backend: reads each call's check results one call late.

    It reads :class:`Audit`'s ``audit`` metric and exact mode's
    ``recompute`` metric (``jdp.strategies.exact(G, recompute_every=k)``),
    whichever the step returns, and acts on a failure by ``on_mismatch``.
    """

    def __init__(
        self, on_mismatch: Policy, backend: str, devices: list[jax.Device], checks: tuple[str, ...]
    ):
        self.on_mismatch, self.backend = on_mismatch, backend
        self.devices, self.checks = devices, checks
        self._held: tuple[dict[str, jax.Array], Any, Any] | None = None
        self._warned: set[tuple[str, int, int]] = set()

    def note(self, metrics: Any, state: PyTree) -> None:
        """Keeps this call's results (no wait) after checking the previous call's."""
        missing = [c for c in self.checks if not isinstance(metrics, dict) or c not in metrics]
        if missing:
            raise ValueError(
                f"jdp.{self.backend}: the step checks {missing[0]!r} (jdp.Audit or exact mode's "
                f"recompute_every) but its metrics hold no {missing[0]!r} entry: a wrapper "
                "(jdp.wraps) dropped it. Return the wrapped step's metrics with your own added: "
                "{**metrics, ...}."
            )
        params = jax.tree.structure(state.params) if hasattr(state, "params") else None
        held = ({c: metrics[c] for c in self.checks}, jax.tree.structure(state), params)
        previous, self._held = self._held, held
        if previous is not None:
            self._check(*previous)

    def check(self) -> None:
        """Checks the last call's results now (waits for that step)."""
        held, self._held = self._held, None
        if held is not None:
            self._check(*held)

    def _check(self, results: dict[str, jax.Array], treedef: Any, params: Any) -> None:
        for name, result in results.items():
            if isinstance(result, jax.core.Tracer):
                return
            # Every replica holds the same ints: this process's first one reads them.
            row = [int(v) for v in np.asarray(result.addressable_shards[0].data).reshape(-1)]
            if row[1] < 0:
                continue
            if name == "audit":
                key, message = (name, row[1], row[2]), self._audit_message(row, treedef)
            else:
                key, message = (name, row[5], row[6]), self._recompute_message(row, params)
            self._act(key, message)

    def _act(self, key: tuple[str, int, int], message: str) -> None:
        if self.on_mismatch == "warn":
            # Once per replica and leaf: a replica that stays apart would warn every step.
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(message, RuntimeWarning, stacklevel=5)
        elif self.on_mismatch == "stop":
            _watchdog.end_job(message)
        else:
            raise ReplicaMismatchError(message)

    def _device(self, replica: int) -> str:
        device = self.devices[replica]
        return f"{device}, process {device.process_index}"

    def _where(self, replica: int) -> str:
        return f"device {replica} ({self._device(replica)})"

    def _audit_message(self, row: list[int], treedef: Any) -> str:
        step, replica, leaf, votes = row
        n = len(self.devices)
        name = "state" + _path(treedef, leaf)
        where = f" (device {self._device(replica)})"
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

    def _recompute_message(self, row: list[int], params: Any) -> str:
        step, vr, owner, again, third, odd, leaf = row
        name = "the loss, weight, model state or aux"
        if params is not None and leaf < params.num_leaves:
            name = "grads" + _path(params, leaf)
        head = (
            f"jdp.strategies.exact: at step {step}, virtual replica {vr}'s gradients computed on "
            f"its own {self._where(owner)} differ from their recomputation on "
            f"{self._where(again)}, first at {name}; {self._where(third)} computed them a third "
            "time and "
        )
        if odd == owner:
            return head + (
                f"agreed with the recomputation: device {owner} computed wrong (silent data "
                "corruption), and its gradients went into this step's update on every replica. "
                "Restore the last checkpoint (jdp.fit saves only checked states) and run on "
                f"without device {owner}."
            )
        if odd == again:
            return head + (
                f"agreed with device {owner}: device {again} computed wrong (silent data "
                "corruption) in the recomputation only; the update used the right gradients. "
                f"Run on without device {again}."
            )
        return head + (
            "agreed with neither: no two computations agree, so no one device is to blame (the "
            "model may not be deterministic, or several devices compute wrong). Restore the "
            "last checkpoint and check exact mode on this machine with jdp.testing.check_exact."
        )


def _path(treedef: Any, leaf: int) -> str:
    paths, _ = jax.tree_util.tree_flatten_with_path(treedef.unflatten(range(treedef.num_leaves)))
    return jax.tree_util.keystr(paths[leaf][0])

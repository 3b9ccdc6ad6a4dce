"""Two runs compared step by step: ``python -m jdp.verify RUN_A RUN_B``.

A run's certificate is its state fingerprints: :func:`jdp.metrics.fingerprint`
(and, leaf by leaf, :func:`jdp.metrics.leaf_fingerprints`) logged by
:func:`jdp.fit`, and the fingerprints every :class:`jdp.Checkpointer` records
with a checkpoint. They hash the raw bits of the logical state, so in exact
mode a run on one device and a run on eight print the same numbers, and the
first step whose numbers differ is the first step whose state differs.

``RUN_A`` and ``RUN_B`` are checkpoint folders written by ``jdp.fit``. The
comparison reads the histories saved with their newest checkpoints (the
first logged step whose fingerprint differs, and the leaves that differ
there when per-leaf fingerprints were logged) and the fingerprints of every
checkpoint both runs hold (the leaves that differ at the first checkpoint
that differs). It exits 0 when the runs agree wherever both recorded a
fingerprint, 1 when they differ, 2 when there is nothing to compare.
"""

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax

from jdp import _phases, _replay
from jdp._checkpoint import Checkpointer
from jdp._loop import History
from jdp._replay import PhaseDifference
from jdp._state import TrainState

__all__ = [
    "Difference",
    "PhaseDifference",
    "Report",
    "compare_checkpoints",
    "compare_histories",
    "main",
    "replay",
]


@dataclasses.dataclass(frozen=True)
class Difference:
    """Where two runs first differ.

    Attributes:
      step: the first step whose state fingerprint differs.
      leaves: the leaves whose fingerprints differ at that step, in tree
        order (empty where per-leaf fingerprints were not recorded).
      agreed: how many earlier steps were compared and agreed.
      source: ``"history"`` (fingerprints ``jdp.fit`` logged) or
        ``"checkpoint"`` (fingerprints recorded with the checkpoints).
    """

    step: int
    leaves: tuple[str, ...]
    agreed: int
    source: str


def compare_histories(
    a: History, b: History, *, leaf_names: Sequence[str] | None = None
) -> Difference | None:
    """The first logged step whose ``fingerprint`` differs between two runs, or None.

    Args:
      a: one run's :class:`jdp.History` (its steps logged the
        ``fingerprint`` metric).
      b: the other's.
      leaf_names: names for the rows of ``leaf_fingerprints`` (the leaves'
        paths in tree order); default ``"leaf i"``.

    Raises:
      TypeError: ``a`` or ``b`` is not a :class:`jdp.History`, or ``leaf_names`` is a string.
      ValueError: the histories share no step with a logged fingerprint.

    Example:
      >>> import jdp, jdp.verify
      >>> a = jdp.History(train=[{"step": 1, "fingerprint": [1, 2]},
      ...                        {"step": 2, "fingerprint": [3, 4]}])
      >>> b = jdp.History(train=[{"step": 1, "fingerprint": [1, 2]},
      ...                        {"step": 2, "fingerprint": [3, 5]}])
      >>> jdp.verify.compare_histories(a, b)
      Difference(step=2, leaves=(), agreed=1, source='history')
    """
    for name, history in (("a", a), ("b", b)):
        if not isinstance(history, History):
            raise TypeError(
                f"jdp.verify.compare_histories: {name} must be a jdp.History (what jdp.fit "
                f"returns, or jdp.History.from_dict of a saved one), got {type(history).__name__}."
            )
    if isinstance(leaf_names, str):
        raise TypeError(
            "jdp.verify.compare_histories: leaf_names must be a sequence of names, one per "
            f"leaf (e.g. a list of key paths), or None; got the string {leaf_names!r}."
        )
    logged_a, logged_b = _logged(a, leaf_names), _logged(b, leaf_names)
    if not set(logged_a) & set(logged_b):
        raise ValueError(
            "jdp.verify.compare_histories: the two histories share no step with a logged fingerprint; "
            "train both with make_train_step(..., metrics=[jdp.metrics.fingerprint()]) and "
            "the same log_every."
        )
    return _first_difference(logged_a, logged_b, "history")


def compare_checkpoints(run_a: str | pathlib.Path, run_b: str | pathlib.Path) -> "Report":
    """Compares two checkpoint folders written by ``jdp.fit``: their histories and checkpoints.

    Raises:
      FileNotFoundError: a folder is missing or holds no checkpoint.

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, jdp, jdp.verify
      >>> state = jdp.TrainState.create(params=jnp.ones(3), tx=optax.sgd(0.1))
      >>> runs = [tempfile.mkdtemp(), tempfile.mkdtemp()]
      >>> for run, p in zip(runs, [1.0, 2.0]):
      ...     with jdp.Checkpointer(run) as ckpt:
      ...         ckpt.save(0, state)
      ...         ckpt.save(1, state.replace(params=jnp.full(3, p)))
      >>> report = jdp.verify.compare_checkpoints(*runs)
      >>> report.checkpoint  # no history was logged; checkpoint 1 differs in one leaf
      Difference(step=1, leaves=('.params',), agreed=1, source='checkpoint')
      >>> report.replay_from  # where jdp.verify.replay starts: the newest agreed checkpoint
      0
    """
    with _open(run_a) as ckpt_a, _open(run_b) as ckpt_b:
        prints_a, prints_b = _recorded(ckpt_a), _recorded(ckpt_b)
        histories = [_saved_history(ckpt) for ckpt in (ckpt_a, ckpt_b)]
    common = sorted(set(prints_a) & set(prints_b))
    names = list(prints_a[common[-1]][1] or {}) if common else None
    try:
        history, compared = compare_histories(*histories, leaf_names=names), True
    except ValueError:  # no fingerprint logged at a common step
        history, compared = None, False
    at_checkpoint = _first_difference(prints_a, prints_b, "checkpoint")
    return Report(history, at_checkpoint, common, compared)


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`compare_checkpoints` found.

    Attributes:
      history: the first logged step that differs, or None.
      checkpoint: the first checkpoint both runs hold whose fingerprint
        differs, or None.
      checkpoints: the checkpoint steps both runs hold with fingerprints.
      history_compared: whether both histories logged a fingerprint at a
        common step.
    """

    history: Difference | None
    checkpoint: Difference | None
    checkpoints: list[int]
    history_compared: bool

    @property
    def identical(self) -> bool:
        """Whether the runs agree wherever both recorded a fingerprint."""
        return self.history is None and self.checkpoint is None

    @property
    def replay_from(self) -> int | None:
        """The newest checkpoint both runs hold, in agreement, before they first differ.

        Where :func:`replay` starts: restore it, and replay the steps after
        it. None where the runs agree or no such checkpoint precedes the
        difference (replay from the initial state).
        """
        found = [d.step for d in (self.history, self.checkpoint) if d is not None]
        if not found:
            return None
        earlier = [step for step in self.checkpoints if step < min(found)]
        return max(earlier) if earlier else None


def replay(
    step_a: Any,
    step_b: Any,
    state: TrainState,
    batches: Sequence[Any],
    *,
    batches_b: Sequence[Any] | None = None,
) -> PhaseDifference | None:
    """Replays steps on two configurations and names the first phase whose output differs.

    Both steps start from ``state`` (one copy on the host, e.g. the last
    checkpoint two runs agree on, restored) and take ``batches`` (the global
    batches that followed it), compiled anew so that each phase sends its
    per-leaf fingerprints to the host: every replica's forward and backward
    pass, the reduction, the update, and the state the step returned. In
    exact mode the phases hash the same bits on every device count and
    backend; elsewhere compare configurations with the same device count
    (the forward/backward phase sums each replica's own gradients, which
    depend on how the batch is split).

    Args:
      step_a: a training step wrapped by a backend (``jdp.shard_map(...)``).
      step_b: another, e.g. on another device count, backend or version, or
        the same step with a fault.
      state: the ``jdp.TrainState`` both start from, one copy on the host.
      batches: the global batches to replay, in order.
      batches_b: the batches ``step_b`` takes, where their form differs
        (``jdp.testing.with_faults`` adds the fault rows); default
        ``batches``.

    Returns:
      The first step and phase that differ, with the leaves and the
      replicas, or None when every replayed step agrees (a difference
      between the recorded runs that does not recur, such as a transient
      hardware fault).

    Raises:
      TypeError: a step not built by ``jdp.make_train_step`` and wrapped
        by a backend, or a state that is not a ``jdp.TrainState``.
      ValueError: no batch, several processes, or steps whose phases hold
        different leaves (another model or optimizer).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jdp, jdp.verify
      >>> def build(n):
      ...     mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",))
      ...     return jdp.shard_map(jdp.make_train_step(lambda p, b: jnp.mean((b * p) ** 2),
      ...         strategy=jdp.strategies.exact(8)), mesh=mesh)
      >>> state = jdp.TrainState.create(params=jnp.ones(()), tx=optax.sgd(0.1))
      >>> batches = [np.arange(16, dtype=np.float32)] * 2
      >>> print(jdp.verify.replay(build(1), build(8), state, batches))
      None
    """
    _replay.check_runner(step_a, "step_a")
    _replay.check_runner(step_b, "step_b")
    _check_replay_inputs(state, batches)
    if batches_b is None:
        batches_b = batches
    _check_replay_inputs(state, batches_b)
    if len(batches_b) != len(batches):
        raise ValueError(
            f"jdp.verify.replay: batches_b has length {len(batches_b)} and batches "
            f"{len(batches)}; pass one for each replayed step."
        )
    runners = [step.with_step(step.step) for step in (step_a, step_b)]
    records = [_phases.Record(), _phases.Record()]
    states = [runner.replicate(state) for runner in runners]
    for pair in zip(batches, batches_b, strict=True):
        seen = []
        for i, (runner, record) in enumerate(zip(runners, records, strict=True)):
            states[i], phases = _replay.run_observed(runner, states[i], pair[i], record)
            seen.append(phases)
        if not seen[0] and not seen[1]:
            raise ValueError(
                "jdp.verify.replay: the steps marked no phase; a step must call the step "
                "jdp.make_train_step built (a plain function, or one that hides it, cannot be replayed)."
            )
        step = int(jax.device_get(runners[0].unreplicate(states[0].step)))
        found = _replay.phase_difference(step, seen, records)
        found = found or _replay.after_difference(step, runners, states)
        if found is not None:
            return found
    return None


def _check_replay_inputs(state: object, batches: object) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            "jdp.verify.replay: state must be a jdp.TrainState (one copy on the host, e.g. "
            f"jdp.Checkpointer(...).restore(step, template)), got {type(state).__name__}."
        )
    if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes)):
        raise TypeError(
            "jdp.verify.replay: batches must be a list of global batches, got "
            f"{type(batches).__name__}."
        )
    if not batches:
        raise ValueError("jdp.verify.replay: batches is empty; pass the batches to replay.")
    if jax.process_count() > 1:
        raise ValueError(
            "jdp.verify.replay runs in one process; replay the step on this host's devices."
        )


# Each run's record: {step: (the state's fingerprint, {leaf name: its fingerprint} or None)}.
Record = dict[int, tuple[Any, dict[str, Any] | None]]


def _first_difference(a: Record, b: Record, source: str) -> Difference | None:
    """The first step both records hold whose fingerprints differ, with the leaves that differ."""
    for agreed, step in enumerate(sorted(set(a) & set(b))):
        (print_a, leaves_a), (print_b, leaves_b) = a[step], b[step]
        if print_a != print_b:
            if leaves_a is None or leaves_b is None:
                return Difference(step, (), agreed, source)
            names = tuple(name for name, v in leaves_a.items() if leaves_b.get(name) != v)
            return Difference(step, names, agreed, source)
    return None


def _logged(history: History, names: Sequence[str] | None) -> Record:
    """A history's record; its leaf rows named by ``names`` where they fit, else ``"leaf i"``."""
    out: Record = {}
    for row in history.train:
        if "fingerprint" not in row:
            continue
        rows, leaves = row.get("leaf_fingerprints"), None
        if rows is not None:
            labels = [f"leaf {i}" for i in range(len(rows))]
            if names is not None and len(names) == len(rows):
                labels = list(names)
            leaves = dict(zip(labels, rows, strict=True))
        out[row["step"]] = (row["fingerprint"], leaves)
    return out


def _recorded(ckpt: Checkpointer) -> Record:
    """The checkpoints' record, for the checkpoints that recorded fingerprints."""
    prints = {step: ckpt.fingerprints(step) for step in ckpt.all_steps()}
    return {step: (p["state"], p["leaves"]) for step, p in prints.items() if p is not None}


def _saved_history(ckpt: Checkpointer) -> History:
    """The History ``jdp.fit`` saved with the newest checkpoint (empty if none was)."""
    return History.from_dict(ckpt.extra().get("history"))


def _open(run: str | pathlib.Path) -> Checkpointer:
    path = pathlib.Path(run)
    if not path.is_dir():
        raise FileNotFoundError(f"jdp.verify: {path} is not a checkpoint folder.")
    # max_to_keep=None: opening a folder to read it must never delete a checkpoint.
    ckpt = Checkpointer(path, max_to_keep=None)
    if not ckpt.all_steps():
        ckpt.close()
        raise FileNotFoundError(f"jdp.verify: no checkpoint in {path}.")
    return ckpt


def _describe(d: Difference) -> list[str]:
    where = "a logged step" if d.source == "history" else "a checkpoint"
    lines = [f"  first differ at step {d.step} ({where}; the {d.agreed} compared before agree)"]
    if d.leaves:
        more = f", and {len(d.leaves) - 5} more" if len(d.leaves) > 5 else ""
        lines.append(
            f"  leaves that differ there ({len(d.leaves)}): {', '.join(d.leaves[:5])}{more}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jdp.verify RUN_A RUN_B``: prints where two runs first differ; returns the status."""
    parser = argparse.ArgumentParser(
        prog="python -m jdp.verify", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("run_a", help="a checkpoint folder written by jdp.fit")
    parser.add_argument("run_b", help="another one")
    args = parser.parse_args(argv)
    try:
        report = compare_checkpoints(args.run_a, args.run_b)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    if not report.history_compared and not report.checkpoints:
        print(
            "jdp.verify: nothing to compare: no step has a fingerprint in both runs (log "
            "jdp.metrics.fingerprint() with jdp.fit, or checkpoint both at the same steps).",
            file=sys.stderr,
        )
        return 2
    header = f"jdp.verify: {args.run_a} and {args.run_b}"
    if report.identical:
        logged = "compared" if report.history_compared else "not logged"
        print(f"{header} agree wherever both recorded a fingerprint.")
        print(f"  logged fingerprints: {logged}; checkpoints compared: {report.checkpoints}")
        return 0
    print(f"{header} differ.")
    for difference in (report.history, report.checkpoint):
        if difference is not None:
            print("\n".join(_describe(difference)))
    start = report.replay_from
    where = (
        "the initial state" if start is None else f"checkpoint {start}, the newest both agree on"
    )
    print(f"  to name the phase, jdp.verify.replay the steps after {where}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""A thin, optional training loop. Read it, copy it, replace it.

Everything here is a composition of public jdp pieces: a wrapped step, any
iterable of host batches, prefetching, evaluation and a Checkpointer.
"""

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np

from jdp import _layout, _recycle, _standby, _standby_restore, _timed, _tree, _watchdog
from jdp._args import check_bool, check_int
from jdp._checkpoint import Checkpointer
from jdp._data import prefetch_to_device
from jdp._evaluation import evaluate
from jdp._ledger import Ledger, Record, summary
from jdp._replication import check_replicas_agree, gather_replicas, refuse_consumed, unreplicate
from jdp._steps import EvalStep
from jdp._tree import PyTree
from jdp.backends import Runner
from jdp.metrics import Rule, rule_of

if TYPE_CHECKING:
    from rich.progress import Progress


@dataclasses.dataclass
class History:
    """What :func:`fit` observed: one row per logged step and per evaluation.

    Saved with every checkpoint ``fit`` writes and restored on resume, so the
    curves of a resumed run continue; ``resumed_at`` lists the steps a run
    resumed from. ``time`` is where the wall time went, in seconds by kind
    (start-up, compilation, data, training, evaluation, checkpoint save and
    restore, hooks, and across restarts the work redone, the restarts and
    idle time between runs; ``docs/multi-host.md``), summed over every run
    that continued this one.
    """

    train: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eval: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed_at: list[int] = dataclasses.field(default_factory=list)
    time: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, saved: dict[str, Any] | None) -> "History":
        """A History from ``dataclasses.asdict(history)`` as a checkpoint saved it (empty: None)."""
        if saved is not None and not isinstance(saved, Mapping):
            raise TypeError(
                "jdp.History.from_dict takes the dict dataclasses.asdict(history) gives (as a "
                f"checkpoint's extra()['history'] holds it), or None; got {type(saved).__name__}."
            )
        saved = saved or {}
        rows = {name: list(saved.get(name, [])) for name in ("train", "eval", "resumed_at")}
        return cls(**rows, time={k: float(v) for k, v in dict(saved.get("time", {})).items()})


T = TypeVar("T")


def fit(
    train_step: Runner,
    state: T,
    train_data: Iterable[PyTree],
    *,
    num_steps: int,
    eval_step: Runner | None = None,
    eval_data: Callable[[], Iterable[PyTree]] | None = None,
    eval_every: int | None = None,
    checkpointer: Checkpointer | None = None,
    checkpoint_every: int | None = None,
    on_epoch_end: Callable[[int, T], T | None] | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
    log_every: int = 10,
    progress: bool = True,
    time_every: int = 0,
) -> tuple[T, History]:
    """Trains until ``state.step == num_steps``, resuming from the latest checkpoint.

    Args:
      train_step: ``jdp.pmap(make_train_step(...))`` or ``jdp.shard_map(...)``.
      state: the initial state, placed by ``train_step.replicate``; also the
        template for restoring. A :class:`jdp.TrainState` (or a subclass), or
        any pytree a custom step accepts that has a ``step`` counter
        (attribute or dict entry).
      train_data: any iterable of host batches (this process's part of each
        global batch): a :class:`jdp.BatchIterator`, a generator, a grain
        loader. If it has ``get_state()``/``set_state()``, its position is
        checkpointed and restored, so a resumed run sees the same batches.
      num_steps: the step counter to stop at.
      eval_step: a wrapped :func:`jdp.make_eval_step`, run every
        ``eval_every`` steps and at the end over ``eval_data()`` (a callable
        returning a fresh one-pass iterable of host batches).
      checkpointer: save every ``checkpoint_every`` steps and at the end, and
        resume from its latest checkpoint when there is one. In a script that
        called ``jdp.distributed.initialize()``, SIGTERM (preemption) makes
        fit save the last completed step (every process agrees on it within
        4 steps) and exit with code 75, "run me again" (``jdp.launch
        --max-restarts``, SLURM ``--requeue``). With its ``local_directory``,
        fit keeps the newest completed step for the processes left after a
        failure to write out, and resumes from such a copy when it is newer
        than the latest checkpoint (``docs/checkpointing.md``).
      on_epoch_end: called as ``on_epoch_end(epoch, state)`` after the step
        that completes an epoch (for iterators with ``is_new_epoch`` and
        ``epoch``, like Chainer's ``auto_new_epoch``); may return a new state.
      callbacks: each called with every logged row: a dict with ``split``
        (``"train"`` every ``log_every`` steps, ``"eval"`` after each
        evaluation), ``step``, the global metrics and the per-replica lists;
        e.g. :class:`jdp.TensorBoardLogger`. ``log_every=1`` calls them every
        step (and reads metrics back every step). A train row's ``time`` is
        the wall seconds so far by kind, as in ``History.time``; on process
        0 of a multi-process job its ``pace`` is every process's data wait
        per step over its newest logged window, in ms (``data_ms/<process>``),
        its compute before the first collective and its wait in it per timed
        step (``compute_ms/<process>``, ``collective_ms/<process>``), their
        ``spread_ms`` and the median ``step_ms``.
      log_every: steps between metric read-backs (each waits for the device).
      progress: show a rich progress bar with the loss and throughput, and
        at the end one line saying where the time went.
      time_every: run every this many steps (0: never) a twin of the step
        that reads from the device how long each process computed and waited
        in the first collective, so the pace report can name a process slow
        inside its step (compiled once more; ``docs/multi-host.md``). In
        exact mode a timed step computes the same bits; otherwise XLA may
        round a value differently in it (the last bit of the loss, in tests).
        Not on a mesh with model axes, where JAX runs no host callback.

    Returns:
      ``(state, history)``.
    """
    _check_fit_args(
        train_step, num_steps, eval_step, eval_data, eval_every, checkpointer, checkpoint_every
    )
    _check_fit_inputs(state, train_data, checkpointer, on_epoch_end, callbacks, log_every, progress)
    standby = _standby_for(train_step, state, checkpointer)
    train_step, run = _runs(train_step, state, standby)
    timed = _timed.timed(train_step, time_every)
    state, history, ledger, record = _start(state, train_data, num_steps, checkpointer, standby)
    step = _step_of(state)
    batches, position = _batches(train_step, train_data)
    first, ckpt = True, (train_step, checkpointer, record, ledger, run)
    with _progress_bar(progress) as bar, _preemptible(checkpointer), _standby.active(standby):
        task = bar.add_task("train", total=num_steps, completed=step, status="")
        rows = _Rows(history, callbacks, bar, task, _rules(train_step))
        while step < num_steps:
            _enter(ledger, "startup" if first else "data", step + 1)
            batch, (position, examples, epoch) = _next(batches, step, num_steps)
            state, metrics = _call(run, timed, state, batch, step + 1, ledger, first)
            sent = _standby.next_rows(metrics)
            step, first = step + 1, False
            ledger.enter("train")
            # The last logged step's metrics are read now, while this step runs:
            # reading them at once would drain the device queue every log_every steps.
            rows.flush()
            rows.count(examples, metrics.get("weight"))
            state, sent = _end_of_epoch(on_epoch_end, epoch, (state, sent), ledger, run)
            if standby is not None:
                standby.keep(step, state, position, history, sent)
            if step % log_every == 0 or step == num_steps:
                rows.hold(step, metrics, _note_time(ledger, record, step, timed))
            if eval_step is not None and _due(step, num_steps, eval_every):
                _evaluate(eval_step, eval_data, state, step, rows, ledger)
            if checkpointer is not None:
                due = _due(step, num_steps, checkpoint_every)
                _checkpoint(ckpt, step, due, state, position, history, rows)
        ledger.enter("train")
        rows.flush()
        _check_audit(train_step)
    _finish(checkpointer, record, ledger, history, progress)
    if standby is not None:
        standby.remove()
    _watchdog.set_phase("its own code after jdp.fit returned", step)
    return state, history


def _preemptible(checkpointer: Checkpointer | None):
    """A preemption saves and exits where there is a checkpointer to save with."""
    return _watchdog.preemptible() if checkpointer else contextlib.nullcontext()


def _enter(ledger: Ledger, kind: str, step: int) -> None:
    """Charges the time from here to ``kind`` and tells the watchdog what this process does."""
    ledger.enter(kind)
    _watchdog.set_phase(_PHASES[kind], step)


_PHASES = {
    "startup": "data loading",
    "data": "data loading",
    "compile": "the training step",
    "train": "the training step",
    "eval": "evaluation",
    "save": "a checkpoint save",
}


def _call(run, timed: "_timed.Timed | None", state, batch, step: int, ledger: Ledger, first: bool):
    """The call that makes ``step``: timed where due; a first call (of either twin, or of a
    twin that runs a periodic check) compiles."""
    if timed is None or not timed.due(step):
        compiles = first or _compiles(run.runner, state)
        _enter(ledger, "compile" if compiles else "train", step)
        return run(state, batch)
    compiles = not timed.compiled or _compiles(timed.runner, state)
    _enter(ledger, "compile" if compiles else "train", step)
    return timed(run, state, batch)


def _compiles(runner: Runner, state: PyTree) -> bool:
    """Whether ``runner`` compiles a twin in this call (a runner of one's own never says)."""
    compiles = getattr(runner, "compiles", None)
    return bool(compiles is not None and compiles(state))


def _note_time(
    ledger: Ledger, record: Record | None, step: int, timed: "_timed.Timed | None"
) -> dict[str, Any]:
    """The ledger so far, for the watchdog's per-process report and the file; the row's entries.

    The row holds ``time`` (this process's seconds by kind) and, on process 0
    of several, ``pace``: every process's newest data wait per step, and
    device times per timed step (in one process that times, its own).
    """
    seconds = ledger.totals()
    if timed is not None and _watchdog.processes() == 1:
        pace = timed.alone(step, seconds)
    else:
        pace = _watchdog.note_time(step, seconds, None if timed is None else timed.totals())
    if record is not None:
        record.write(seconds)
    return {"time": seconds, "pace": pace} if pace else {"time": seconds}


def _finish(checkpointer, record, ledger: Ledger, history: History, progress: bool) -> None:
    """Waits for the saves, closes the ledger: in the history, the file, printed."""
    if checkpointer is not None:
        ledger.enter("save")
        checkpointer.wait_until_finished()
    history.time = ledger.totals()
    if record is not None:
        record.write(history.time, finished=True)
    if progress:
        print(f"fit: where the time went, {summary(history.time)}", flush=True)


def _writes() -> bool:
    """Process 0 writes the ledger file (every process reads its checkpoints' folder)."""
    return jax.process_index() == 0


def _start(
    state: PyTree,
    train_data,
    num_steps: int,
    checkpointer: Checkpointer | None,
    standby: "_standby.Standby | None",
) -> tuple[PyTree, History, Ledger, Record | None]:
    """The state and history to start from and the ledger.

    The start is the newest of the latest checkpoint and the survivors'
    copies (``Checkpointer(local_directory=...)``), if there is any. The
    ledger starts here, so the checks and the restore are charged too.
    """
    ledger = Ledger()
    record = None if checkpointer is None else Record(checkpointer.directory, _writes())
    history = History()
    latest = None if checkpointer is None else checkpointer.latest_step()
    if standby is not None or latest is not None:
        ledger.enter("restore")
    kept = None if standby is None else _standby_restore.restore(standby.folder, state, latest)
    if kept is not None:
        state, history = _resumed(*kept, train_data, "the survivors' copy")
    elif checkpointer is not None and latest is not None:
        state, history = _resume(checkpointer, state, train_data)
    ledger.enter("startup")
    if history.resumed_at and record is not None:
        ledger.add(record.resumed(_step_of(state), history.time, ledger.started))
    step = _step_of(state)
    if step > num_steps:
        where = ""
        if checkpointer is not None and history.resumed_at:
            where = f" (restored from {checkpointer.directory})"
        raise ValueError(
            f"jdp.fit: the state is at step {step}{where}, past num_steps={num_steps}; fit would "
            f"return it unchanged. Pass num_steps >= {step}, or a fresh checkpoint directory "
            "to train from the start."
        )
    check_replicas_agree(state, "jdp.fit")  # a step reused across fit calls checked only its first
    return state, history, ledger, record


def _evaluate(eval_step, eval_data, state: PyTree, step: int, rows: "_Rows", ledger) -> None:
    rows.flush()
    _enter(ledger, "eval", step)
    rows.record("eval", {"step": step, **evaluate(eval_step, state, eval_data())})


def _checkpoint(ckpt, step: int, due: bool, state, position, history, rows):
    """Saves when ``due`` or on a preemption every process agrees on, once the audit passed.

    ``ckpt``: ``(train_step, checkpointer, ledger record, ledger, the step's spares)``.
    """
    train_step, checkpointer = ckpt[:2]
    preempted = _watchdog.preemption_agreed(step)
    if due or preempted:
        _check_audit(train_step)  # a state whose replicas disagree is never saved
    if due:
        _save(ckpt, step, state, position, history, rows)
    if preempted:
        if not due:
            _save(ckpt, step, state, position, history, rows)
        checkpointer.wait_until_finished()
        _watchdog.exit_preempted(step, str(checkpointer.directory))


def _save(ckpt, step: int, state, position, history: History, rows) -> None:
    """Saves ``step`` with the data position and the history, its ledger as of this save."""
    _, checkpointer, record, ledger, spares = ckpt
    spares.protect(state)  # an asynchronous save may still read it
    rows.flush()
    _enter(ledger, "save", step)
    history.time = ledger.totals()
    extra = {"data": position, "history": dataclasses.asdict(history)}
    checkpointer.save(step, state, extra=extra)
    record.write(ledger.totals(), saved=step)


def _check_audit(train_step) -> None:
    """The replica audit of the step just run, now (a backend's step built with ``audit=``)."""
    check = getattr(train_step, "check_audit", None)
    if check is not None:
        check()


def _next(batches, step: int, num_steps: int):
    try:
        return next(batches)
    except StopIteration:
        raise ValueError(
            f"jdp.fit: train_data ran out after step {step} of {num_steps}; pass a "
            "repeating iterator (BatchIterator(..., repeat=True)) or fewer steps."
        ) from None


def _due(step: int, num_steps: int, every: int | None) -> bool:
    return step == num_steps or bool(every and step % every == 0)


def _check_fit_args(
    train_step, num_steps, eval_step, eval_data, eval_every, checkpointer, checkpoint_every
) -> None:
    if isinstance(getattr(train_step, "step", None), EvalStep):
        raise TypeError(
            "jdp.fit: train_step is an evaluation step (jdp.make_eval_step); pass a wrapped "
            "jdp.make_train_step as train_step and the evaluation step as eval_step."
        )
    check_int(num_steps, "num_steps", minimum=0, where="jdp.fit")
    for name, every in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
        if every is not None:
            check_int(every, name, minimum=1, where="jdp.fit")
    if (eval_step is None) != (eval_data is None):
        given, missing = (
            ("eval_step", "eval_data") if eval_data is None else ("eval_data", "eval_step")
        )
        raise ValueError(f"jdp.fit: {given} was given without {missing}; pass both or neither.")
    if eval_data is not None and not callable(eval_data):
        raise TypeError(
            "jdp.fit: eval_data must be a callable returning a fresh iterable of batches, e.g. "
            "lambda: jdp.BatchIterator(test, 64, shuffle=False, remainder='pad', repeat=False)."
        )
    if eval_every is not None and eval_step is None:
        raise ValueError("jdp.fit: eval_every was given without eval_step and eval_data.")
    if checkpoint_every is not None and checkpointer is None:
        raise ValueError(
            "jdp.fit: checkpoint_every was given without a checkpointer, so nothing would be "
            "saved; pass checkpointer=jdp.Checkpointer(directory)."
        )


def _check_fit_inputs(
    state, train_data, checkpointer, on_epoch_end, callbacks, log_every, progress
) -> None:
    check_int(log_every, "log_every", minimum=1, where="jdp.fit")
    check_bool(progress, "progress", where="jdp.fit")
    refuse_consumed(state, "jdp.fit: the state")
    if not isinstance(train_data, Iterable):
        raise TypeError(
            "jdp.fit: train_data must be an iterable of host batches (a jdp.BatchIterator, a "
            f"generator, a data loader), got {type(train_data).__name__}."
        )
    if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
        raise TypeError(
            "jdp.fit: checkpointer must be a jdp.Checkpointer, e.g. "
            f"checkpointer=jdp.Checkpointer(directory), or None, got {type(checkpointer).__name__}."
        )
    if on_epoch_end is not None and not callable(on_epoch_end):
        raise TypeError(
            "jdp.fit: on_epoch_end must be a function (epoch, state) -> state or None, got "
            f"{type(on_epoch_end).__name__}."
        )
    if callable(callbacks) or not isinstance(callbacks, Sequence):
        raise TypeError(
            "jdp.fit: callbacks must be a list of functions of a logged row, e.g. "
            f"callbacks=[jdp.TensorBoardLogger(logdir)], got {type(callbacks).__name__}."
        )
    for i, callback in enumerate(callbacks):
        if not callable(callback):
            raise TypeError(
                f"jdp.fit: callbacks[{i}] is a {type(callback).__name__}, not a function of a "
                "logged row (a dict)."
            )


def _standby_for(
    train_step: Runner, state: PyTree, checkpointer: Checkpointer | None
) -> "_standby.Standby | None":
    """The survivors' copy of this run, when the checkpointer has a local directory."""
    if checkpointer is None or checkpointer.local_directory is None:
        return None
    if getattr(train_step, "donates_state", False):
        raise ValueError(
            "jdp.fit: Checkpointer(local_directory=...) keeps the newest completed step while "
            "the next one runs, but train_step donates its input state to the next one. Wrap "
            "the step with donate_state=False (jdp.pmap(..., donate_state=False) or "
            "jdp.shard_map(..., donate_state=False)); fit then holds up to two more copies of "
            "the state per device."
        )
    folder = _standby.run_folder(checkpointer.local_directory, checkpointer.directory)
    return _standby.Standby(folder, jax.process_index())


def _runs(train_step: Runner, state: PyTree, standby) -> tuple[Runner, "_recycle.Spares"]:
    """The step fit runs, and how it calls it (into a spare, where it keeps states).

    Under a survivors' copy of a split state, the step sends rows too.
    """
    if standby is not None and _standby.sends_rows(state):
        train_step = train_step.with_step(_standby.copying(train_step.step))  # type: ignore[arg-type]
    return train_step, _recycle.Spares(train_step, standby, state)


def _resume(checkpointer: Checkpointer, state: PyTree, train_data) -> tuple[PyTree, History]:
    state, extra = checkpointer.restore(state)
    where = f"checkpoint {_step_of(state)} in {checkpointer.directory}"
    return _resumed(state, extra, train_data, where)


def _resumed(state: PyTree, extra: Any, train_data, where: str) -> tuple[PyTree, History]:
    """The restored state with its data position set and its history continued."""
    step = _step_of(state)
    if not isinstance(extra, dict) or "data" not in extra:
        raise ValueError(
            f"jdp.fit: {where} was not written by fit (its "
            "extra holds no data position), so fit cannot resume it exactly. Restore it "
            "yourself with checkpointer.restore(state) and train into a new directory, or "
            "save with extra={'data': train_data.get_state()}."
        )
    if extra["data"] is not None:
        if not hasattr(train_data, "set_state"):
            raise TypeError(
                f"jdp.fit: {where} holds a data position, but train_data "
                f"({type(train_data).__name__}) has no set_state(); resume with the same "
                "kind of iterator."
            )
        train_data.set_state(extra["data"])
    else:
        warnings.warn(
            f"fit: resuming from step {step}, but the run that wrote it had data without "
            "get_state(), so the data starts over from its beginning.",
            RuntimeWarning,
            stacklevel=3,
        )
    history = History.from_dict(extra.get("history"))
    history.resumed_at.append(step)
    return state, history


def _batches(train_step: Runner, train_data: Iterable[PyTree]) -> tuple[Any, Any]:
    """``(prefetched (batch, position) pairs, the position before the first)``.

    Prefetching reads ahead; each batch carries its iterator position, so
    hooks and checkpoints see the position of the batch just trained on.
    """
    batches = prefetch_to_device(
        _with_position(train_data), shard_fn=lambda item: (train_step.shard(item[0]), item[1])
    )
    return batches, _position(train_data)


def _end_of_epoch(hook, epoch: int | None, stepped, ledger: Ledger, spares):
    """``(state, rows the step sent)`` after ``on_epoch_end``, at the step that ends an epoch.

    ``stepped``: the step's ``(state, rows)``. A hook that returns a new state
    makes the step's rows stale: None, so the survivors' copy takes that
    state's rows itself. The hook may keep either state: neither is recycled.
    """
    state, sent = stepped
    if epoch is None or hook is None:
        return state, sent
    ledger.enter("hooks")
    hooked = _run_hook(hook, epoch, state)
    spares.protect((state, hooked))
    return hooked, (sent if hooked is state else None)


def _run_hook(hook, epoch: int, state: PyTree) -> PyTree:
    new = hook(epoch, state)
    if new is None:
        return state
    if _tree.structure(new) != _tree.structure(state):
        raise TypeError(
            f"jdp.fit: on_epoch_end returned a {type(new).__name__} whose structure differs "
            "from the state's; return the (updated) state or None."
        )
    return new


def _position(data) -> Any:
    return data.get_state() if hasattr(data, "get_state") else None


def _with_position(data: Iterable[PyTree]):
    """``(batch, (position after it, its global example count, finished epoch or None))``."""
    processes = jax.process_count()
    for batch in data:
        examples = jax.tree.leaves(batch)[0].shape[0] * processes if jax.tree.leaves(batch) else 0
        epoch = getattr(data, "epoch", None) if getattr(data, "is_new_epoch", False) else None
        yield batch, (_position(data), examples, epoch)


def _step_of(state: PyTree) -> int:
    counter = getattr(state, "step", None)
    if counter is None and isinstance(state, Mapping):
        counter = state.get("step")
    if counter is None:
        raise TypeError(
            f"jdp.fit counts steps with the state's step counter, but the {type(state).__name__} "
            "state has no .step attribute or 'step' entry; add one that the step increments."
        )
    if _layout.layout_of_leaf(counter) is None:
        raise ValueError(
            "jdp.fit: the state is not placed on the step's devices (its step counter is "
            f"{_where(counter)}): pass state = train_step.replicate(state), as before a "
            "first step call."
        )
    return int(np.asarray(jax.device_get(unreplicate(counter))))


def _where(counter: object) -> str:
    if isinstance(counter, jax.Array):
        return f"an array on one device, {next(iter(counter.devices()))}"
    return f"a host {type(counter).__name__}"


class _Rows:
    """History rows, callbacks and the progress bar; a train row is read one step late.

    ``hold`` keeps the logged step's device metrics and throughput counts
    without waiting for the device; ``flush`` (after the next step has been
    dispatched, or before an evaluation, a checkpoint or the end) reads them
    back and records the row.
    """

    def __init__(
        self,
        history: History,
        callbacks: Sequence[Callable],
        bar: "Progress",
        task,
        rules: Mapping[str, Rule],
    ):
        self.history, self.callbacks, self.bar, self.task = history, callbacks, bar, task
        self.rules = rules
        self._diverged = False
        self._last: tuple[int, int] | None = None  # (step, skipped_steps) of the last row
        self._held: tuple[int, dict, float, int, list, dict[str, Any]] | None = None
        self._weights: list[Any] = []
        self._tick, self._examples = time.perf_counter(), 0

    def count(self, examples: int, weight) -> None:
        self._examples += examples
        if weight is not None:
            self._weights.append(weight)  # device arrays: summed at read time, no wait

    def hold(self, step: int, metrics: dict, timing: dict[str, Any]) -> None:
        elapsed = max(time.perf_counter() - self._tick, 1e-9)
        self._held = (step, metrics, elapsed, self._examples, self._weights, timing)
        self._tick, self._examples, self._weights = time.perf_counter(), 0, []

    def flush(self) -> None:
        if self._held is None:
            return
        step, metrics, elapsed, examples, weights, timing = self._held
        self._held = None
        if weights:  # examples/s, or with a weighted loss weight/s (real examples, tokens)
            rate = {"weight_per_s": float(np.sum(gather_replicas(weights))) / elapsed}
        else:
            rate = {"examples_per_s": examples / elapsed}
        row = {"step": step, **rate, **_global_metrics(metrics, self.rules), **timing}
        self._warn_if_diverged(row)
        self.record("train", row)
        self.bar.update(self.task, completed=step, status=_status(row))

    def _warn_if_diverged(self, row: dict[str, Any]) -> None:
        """Once per run: a non-finite loss on a step that was not skipped, or only skipped steps.

        Read from the row the loop reads back anyway, so it costs nothing on device.
        """
        if self._diverged:
            return
        step, loss, skipped = row["step"], row.get("loss"), row.get("skipped_steps")
        taken = row.get("grads_finite", 1.0) > 0
        message = None
        if isinstance(loss, float) and not math.isfinite(loss) and taken:
            message = (
                f"fit: the loss is {loss} at step {step}, on a step that was not skipped: "
                "training diverged (non-finite params, a non-finite batch, or a negative "
                "jdp.WeightedLoss weight, which makes its step NaN). Lower the "
                "learning rate, clip gradients (jdp.clip_by_global_norm), or train with a "
                "jdp.DynamicLossScale, which skips non-finite steps."
            )
        elif isinstance(skipped, int) and self._last is not None:
            since, skipped_before = self._last
            if step - since >= 10 and skipped - skipped_before == step - since:
                message = (
                    f"fit: every step from {since + 1} to {step} was skipped for non-finite "
                    "gradients: lowering the loss scale does not help, so the params or the "
                    "batches are non-finite. Check the data and the learning rate."
                )
        if isinstance(skipped, int):
            self._last = (step, skipped)
        if message is not None:
            self._diverged = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def record(self, split: str, row: dict[str, Any]) -> None:
        getattr(self.history, split).append(row)
        for callback in self.callbacks:
            callback({"split": split, **row})


def _rules(train_step) -> dict[str, Rule]:
    """The metric rules the wrapped step carries (none for a plain function)."""
    return dict(getattr(getattr(train_step, "step", None), "metric_rules", ()))


def _global_metrics(metrics: dict, rules: Mapping[str, Rule]) -> dict[str, Any]:
    """Each metric combined over replicas by its own rule, plus per-replica lists."""
    host = gather_replicas(metrics)
    weight = np.asarray(host["weight"], np.float64) if "weight" in host else None
    row: dict[str, Any] = {}
    for name, value in host.items():
        row[name] = rule_of(rules, name)(np.asarray(value), weight)
        row[f"{name}_per_replica"] = np.asarray(value).tolist()
    return row


def _status(row: dict[str, Any]) -> str:
    """The progress bar's text: the loss (or, for steps without one, the first two metrics)."""
    rate = row.get("examples_per_s", row.get("weight_per_s", 0.0))
    unit = "ex/s" if "examples_per_s" in row else "weight/s"
    names = ["loss"] if "loss" in row else [k for k in row if k not in _BOOKKEEPING][:2]
    shown = "  ".join(f"{k} {row[k]:.4f}" for k in names if isinstance(row[k], float))
    return f"{shown}  {rate:.0f} {unit}"


_BOOKKEEPING = ("split", "step", "examples_per_s", "weight_per_s", "weight", "seconds", "time")


def _progress_bar(enabled: bool) -> "Progress":
    # Imported here: rich costs a tenth of a second that `import jdp` need not pay.
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        disable=not enabled,
    )

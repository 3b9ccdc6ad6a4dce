"""A thin, optional training loop. Read it, copy it, replace it.

Everything here is a composition of public jdp pieces: a wrapped step, a
BatchIterator, prefetching, evaluation and a Checkpointer.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from jdp.checkpoint import Checkpointer
from jdp.data import BatchIterator, prefetch_to_device
from jdp.evaluation import evaluate
from jdp.replication import gather_replicas, unreplicate
from jdp.types import PyTree


@dataclasses.dataclass
class History:
    """What :func:`fit` observed: one row per logged step and per evaluation."""

    train: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eval: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def fit(
    train_step,
    state: PyTree,
    train_data: BatchIterator,
    *,
    num_steps: int,
    eval_step=None,
    eval_data: Callable[[], Any] | None = None,
    eval_every: int | None = None,
    checkpointer: Checkpointer | None = None,
    checkpoint_every: int | None = None,
    on_epoch_end: Callable[[int, PyTree], PyTree | None] | None = None,
    log_every: int = 10,
    progress: bool = True,
) -> tuple[PyTree, History]:
    """Trains until ``state.step == num_steps``, resuming from the latest checkpoint.

    Args:
      train_step: ``jdp.pmap(make_train_step(...))`` or ``jdp.shard_map(...)``.
      state: the initial state, placed by ``train_step.replicate``; also the
        template for restoring.
      train_data: a repeating :class:`jdp.BatchIterator`; its position is
        checkpointed and restored.
      num_steps: the step counter to stop at.
      eval_step: a wrapped :func:`jdp.make_eval_step`, run every
        ``eval_every`` steps and at the end over ``eval_data()`` (a callable
        returning a fresh one-pass iterable of host batches).
      checkpointer: save every ``checkpoint_every`` steps and at the end, and
        resume from its latest checkpoint when there is one.
      on_epoch_end: called as ``on_epoch_end(epoch, state)`` after the step
        that completes an epoch (Chainer's ``auto_new_epoch``); may return a
        new state.
      log_every: steps between metric read-backs (each blocks on the device).
      progress: show a rich progress bar with the loss and examples/s.

    Returns:
      ``(state, history)``.
    """
    if checkpointer is not None and checkpointer.latest_step() is not None:
        state, extra = checkpointer.restore(state)
        train_data.set_state(extra["data"])
    step = _step_of(state)
    history = History()
    # Prefetching reads ahead; carry each batch's iterator position with it
    # so hooks and checkpoints see the position of the batch just trained on.
    batches = prefetch_to_device(
        _with_position(train_data), shard_fn=lambda item: (train_step.shard(item[0]), item[1])
    )
    position = train_data.get_state()
    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        disable=not progress,
    )
    with bar:
        task = bar.add_task("train", total=num_steps, completed=step, status="")
        tick, examples = time.perf_counter(), 0
        while step < num_steps:
            batch, (position, new_epoch) = next(batches)
            state, metrics = train_step(state, batch)
            step += 1
            examples += train_data.batch_size
            if new_epoch and on_epoch_end is not None:
                state = on_epoch_end(position["epoch"], state) or state
            if step % log_every == 0 or step == num_steps:
                row = _log_row(step, metrics, examples / (time.perf_counter() - tick))
                history.train.append(row)
                bar.update(
                    task,
                    completed=step,
                    status=f"loss {row['loss']:.4f}  {row['examples_per_s']:.0f} ex/s",
                )
                tick, examples = time.perf_counter(), 0
            if eval_step is not None and (
                step == num_steps or (eval_every and step % eval_every == 0)
            ):
                state, result = evaluate(eval_step, state, eval_data())
                history.eval.append({"step": step, **result})
            if checkpointer is not None and (
                step == num_steps or (checkpoint_every and step % checkpoint_every == 0)
            ):
                checkpointer.save(step, state, extra={"data": position})
    if checkpointer is not None:
        checkpointer.wait_until_finished()
    return state, history


def _with_position(data: BatchIterator):
    for batch in data:
        yield batch, (data.get_state(), data.is_new_epoch)


def _step_of(state: PyTree) -> int:
    return int(np.asarray(jax.device_get(unreplicate(state.step))))


def _log_row(step: int, metrics: dict, examples_per_s: float) -> dict[str, Any]:
    host = gather_replicas(metrics)
    row: dict[str, Any] = {"step": step, "examples_per_s": examples_per_s}
    for name, value in host.items():
        value = np.asarray(value)
        row[name] = float(value.mean())
        row[f"{name}_per_replica"] = value.tolist()
    return row

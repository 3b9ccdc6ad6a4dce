"""What the examples share: the flags, the strategy by name, and one jdp.fit run.

Each example builds its data, model, loss and optimizer, and hands them to
:func:`train`, which wraps the steps for the devices present, checkpoints into
``--out`` (a second run with the same ``--out`` resumes), evaluates, writes
TensorBoard event files and a ``summary.json`` with the measured numbers.
"""

import argparse
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

STRATEGIES = ("data_parallel", "zero1", "exact", "fsdp")


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every example takes; each example adds its model's."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--strategy", choices=STRATEGIES, default="data_parallel")
    p.add_argument(
        "--virtual-replicas",
        type=int,
        default=8,
        help="exact mode's G: the global batch is split into G micro-batches summed in one "
        "fixed order, so the result is bitwise the same on any device count that divides G",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch")
    p.add_argument("--lr", type=float, default=3e-4, help="the peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument(
        "--decay-steps",
        type=int,
        default=None,
        help="the schedule's length (default --steps); keep it when a later run extends --steps",
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, required=True, help="checkpoints, logs, summary")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="run on this many forced CPU devices (jdp.force_cpu_devices) instead of the "
        "devices present",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    return p


def start(args: argparse.Namespace) -> None:
    """Forces CPU devices when asked; must run before anything starts a JAX backend."""
    if args.cpu_devices is not None:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jdp

        jdp.force_cpu_devices(args.cpu_devices)


def strategy(name: str, virtual_replicas: int, layers: Callable[[str], bool] | None = None):
    """The strategy a ``--strategy`` flag names; ``layers`` is fsdp's layer predicate."""
    import jdp

    if name == "zero1":
        return jdp.strategies.zero1()
    if name == "exact":
        return jdp.strategies.exact(virtual_replicas)
    if name == "fsdp":
        return jdp.strategies.fsdp(layers=layers)
    return jdp.strategies.data_parallel()


def optimizer(args: argparse.Namespace):
    """AdamW on a warmup-cosine schedule, clipped, with no decay on vectors (norms, biases)."""
    import jax
    import optax

    import jdp

    length = args.decay_steps or args.steps
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, length), length, end_value=args.lr / 10
    )

    def matrices(params):
        return jax.tree.map(lambda x: x.ndim > 1, params)

    adamw = optax.adamw(schedule, b2=0.95, weight_decay=args.weight_decay, mask=matrices)
    return optax.chain(jdp.clip_by_global_norm(1.0), adamw)


def in_blocks(path: str) -> bool:
    """fsdp's ``layers`` for a model whose ``params["blocks"]`` each go through ``layer``.

    Those leaves are gathered by ``jdp.strategies.layer``, one block at a time.
    """
    return path.startswith("['blocks']")


def train(
    args: argparse.Namespace,
    *,
    loss_fn: Callable[..., Any],
    metric_fn: Callable[..., Any],
    params: Any,
    train_split: dict[str, Any],
    test_split: dict[str, Any],
    layers: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Trains with ``jdp.fit`` and returns (and writes) the run's summary.

    ``train_split`` is shuffled by ``--seed`` and repeated; ``test_split`` is
    read once per evaluation, its last batch padded (metrics weight the padding 0).
    """
    import functools

    import jax
    import jax.numpy as jnp

    import jdp

    train_data = jdp.BatchIterator(train_split, args.batch_size, seed=args.seed)
    eval_data = functools.partial(
        jdp.BatchIterator, test_split, args.batch_size, shuffle=False, remainder="pad", repeat=False
    )

    chosen = strategy(args.strategy, args.virtual_replicas, layers)
    precision = None if args.precision == "float32" else jnp.bfloat16
    train_step = jdp.shard_map(jdp.make_train_step(loss_fn, strategy=chosen, precision=precision))
    eval_step = jdp.shard_map(jdp.make_eval_step(metric_fn, strategy=chosen))
    state = jdp.TrainState.create(params=params, tx=optimizer(args))
    args.out.mkdir(parents=True, exist_ok=True)
    logger = jdp.TensorBoardLogger(args.out / "tensorboard")
    started = time.perf_counter()
    with jdp.Checkpointer(args.out / "checkpoints", max_to_keep=2) as checkpointer:
        state, history = jdp.fit(
            train_step,
            train_step.replicate(state),
            train_data,
            num_steps=args.steps,
            eval_step=eval_step,
            eval_data=eval_data,
            eval_every=args.eval_every,
            checkpointer=checkpointer,
            checkpoint_every=args.checkpoint_every,
            callbacks=[logger],
            log_every=args.log_every,
            progress=not args.no_progress,
        )
    logger.close()
    summary = _summary(args, history, params, time.perf_counter() - started, jax.device_count())
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def _summary(args, history, params, seconds: float, devices: int) -> dict[str, Any]:
    import jax

    rates = [row["examples_per_s"] for row in history.train if "examples_per_s" in row]
    # The first logged row's rate includes compilation; the median of the rest is the step.
    steady = statistics.median(rates[1:] or rates) if rates else float("nan")
    return {
        "strategy": args.strategy,
        "devices": devices,
        "device_kind": jax.devices()[0].device_kind,
        "parameters": sum(x.size for x in jax.tree.leaves(params)),
        "global_batch": args.batch_size,
        "steps": args.steps,
        "resumed_at": history.resumed_at,
        "train_loss": history.train[-1]["loss"] if history.train else None,
        "eval": history.eval[-1] if history.eval else None,
        "examples_per_s": steady,
        "step_time_s": args.batch_size / steady,
        "wall_s": seconds,
    }

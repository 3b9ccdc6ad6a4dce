"""The main job: a Flax CNN on real handwritten digits, 8 devices against 1.

    python -m jdp.demo [--devices 8] [--steps 600] [--batch-size 128]
                       [--precision float32] [--backend pmap] [--out out/demo]
                       [--resume] [--no-reference]

scikit-learn's 8x8 digits (1,797 real scans that ship inside scikit-learn, no
download) are split into 1,440 training and 357 test images. The CNN trains
data parallel on 8 CPU devices in exact mode (``jdp.strategies.exact(8)``,
docs/exact.md), float32. It is evaluated exactly on every test image (357 is
not a multiple of 8: the last batch is padded, and the metric leaves the
padding out). The same model is then trained on one device from the same
seed and data, and the two end bit for bit identical. ``--precision
bfloat16`` (float32 master weights, bfloat16 compute) or ``float16`` (with
dynamic loss scaling) train the ordinary step instead, whose 1-vs-8
difference is rounding grown by training (``--exact`` keeps exact mode).
The figure shows what jdp promises on this run: N devices train like 1,
every replica's loss, the reduced gradient's norm on N devices and on 1 (in
float16, the loss scale and the skipped steps instead), and the test
accuracy. The figure's bytes depend only on the run, so ``make demo``
redraws the README's image and the test suite checks it.

The pieces (data, model, losses, plot) are importable for the notebook
``notebooks/04_digits.ipynb``. Importing this module starts no JAX backend.
"""

import argparse
import json
import os
import pathlib
import shutil
import time

from jdp import _extras

_extras.require(("flax", "sklearn", "matplotlib"), "demo", "jdp.demo")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

PRECISIONS = ("float32", "bfloat16", "float16")
TRAIN_SIZE = 1440


def load_splits(seed: int = 0) -> tuple[dict, dict]:
    """scikit-learn's digits as ``(train, test)`` dicts of ``image`` (N, 8, 8, 1) and ``label``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    train, test = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return (
        {"image": images[train], "label": labels[train]},
        {"image": images[test], "label": labels[test]},
    )


class CNN(nn.Module):
    """Two 3x3 convolutions, average pooling and two dense layers."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


def logits_of(params, images):
    return CNN().apply({"params": params}, images).astype(jnp.float32)


def loss_fn(params, batch):
    """Mean cross-entropy over this replica's examples, and its batch accuracy."""
    logits = logits_of(params, batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def metric_fn(params, batch):
    """Accuracy and loss over the real examples of a padded batch, for exact evaluation."""
    logits = logits_of(params, batch["image"])
    correct = jnp.argmax(logits, -1) == batch["label"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return {
        "accuracy": jdp.weighted_mean(correct, batch["mask"]),
        "loss": jdp.weighted_mean(loss, batch["mask"]),
    }


def precision_setup(precision: str):
    """``(jdp.Policy, loss scale)`` for a precision name.

    bfloat16 has float32's exponent range, so its gradients do not underflow
    and need no loss scaling; float16 does, so it gets dynamic loss scaling.
    """
    if precision == "float32":
        return jdp.Policy(), None
    dtype = getattr(jnp, precision)
    scale = jdp.DynamicLossScale(jnp.float32(2.0**15)) if precision == "float16" else None
    return jdp.Policy(dtype, cast_batch=("image",)), scale


def max_difference(a, b) -> float:
    """The largest absolute difference between two trees of arrays."""
    gaps = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree.leaves(gaps))


def plot_promises(history, reference, result: dict):
    """The demo's figure: four panels, one promise each."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.9))
    _plot_one_vs_n(axes[0], history, reference, result)
    _plot_replica_band(axes[1], history, result["devices"])
    if result["precision"] == "float16":
        _plot_loss_scale(axes[2], history)
    else:
        _plot_grad_norm(axes[2], history, reference, result["devices"])
    _plot_accuracy(axes[3], history, result["test_accuracy"])
    for ax in axes:
        for step in history.resumed_at:
            ax.axvline(step, color="gray", ls=":", lw=1)
            ax.annotate("resumed", (step, 0.97), xycoords=("data", "axes fraction"), fontsize=7)
    fig.suptitle(
        f"jdp: CNN on 1,440 digits, {result['devices']} devices, {result['precision']}, "
        f"global batch {result['global_batch']}"
    )
    fig.tight_layout()
    return fig


def _rows(history, key):
    rows = [r for r in history.train if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def _plot_one_vs_n(ax, history, reference, result):
    steps, loss = _rows(history, "loss")
    ax.plot(steps, loss, lw=2.5, alpha=0.6, label=f"{result['devices']} devices")
    if reference is not None:
        ref_steps, ref_loss = _rows(reference, "loss")
        ax.plot(ref_steps, ref_loss, "k--", lw=1, label="1 device")
        text = f"max |Δparams| {result['max_param_diff']:.1e}"
        if result["bitwise_equal"]:
            text += "\nbitwise identical\n(exact mode)"
        elif not result["exact_mode"]:
            text += "\nrounding, grown by\ntraining; --exact:\nbitwise identical"
    else:
        text = "1-device run skipped (--no-reference)"
    ax.text(0.45, 0.68, text, transform=ax.transAxes, fontsize=9)
    n = result["devices"]
    title = f"{n} devices train like 1" if result["bitwise_equal"] else f"{n} devices against 1"
    ax.set(xlabel="step", ylabel="train loss", yscale="log", title=title)
    ax.legend(loc="lower left")


def _replica_losses(row) -> list[float]:
    """Each replica's own loss; in exact mode, each virtual replica's."""
    if "virtual_replica_loss_per_replica" in row:
        return row["virtual_replica_loss_per_replica"][0]
    return row["loss_per_replica"]


def _plot_replica_band(ax, history, n):
    rows = [r for r in history.train if "loss_per_replica" in r]
    steps = [r["step"] for r in rows]
    per_replica = np.array([_replica_losses(r) for r in rows])
    n = per_replica.shape[1]
    ax.fill_between(steps, per_replica.min(1), per_replica.max(1), alpha=0.3, label="replica range")
    ax.plot(steps, [r["loss"] for r in rows], "k", lw=1.2, label="global (step's weighting)")
    ax.set(xlabel="step", ylabel="train loss", yscale="log", title=f"{n} replicas, own data")
    ax.legend(loc="lower left")


def _plot_grad_norm(ax, history, reference, n):
    steps, norm = _rows(history, "grad_norm")
    ax.plot(steps, norm, lw=2.5, alpha=0.6, label=f"{n} devices (all-reduced)")
    if reference is not None:
        ax.plot(*_rows(reference, "grad_norm"), "k--", lw=1, label="1 device")
    ax.set(xlabel="step", yscale="log", title="gradient norm, the reduced gradient")
    ax.legend(loc="lower left")


def _plot_loss_scale(ax, history):
    steps, scale = _rows(history, "loss_scale")
    _, skipped = _rows(history, "skipped_steps")
    ax.step(steps, scale, where="post", label="loss scale")
    new = [s for s, a, b in zip(steps[1:], skipped, skipped[1:], strict=False) if b > a]
    ax.plot(new, [scale[steps.index(s)] for s in new], "rv", label="skipped by every replica")
    ax.set(xlabel="step", yscale="log", title=f"loss scale ({int(skipped[-1])} steps skipped)")
    ax.legend(loc="lower right")


def _plot_accuracy(ax, history, final):
    steps = [r["step"] for r in history.eval]
    accuracy = [r["accuracy"] for r in history.eval]
    ax.plot(steps, accuracy, "o-")
    ax.set(
        xlabel="step",
        ylabel="test accuracy",
        ylim=(max(min([*accuracy, final]) - 0.02, 0.0), 1.0 + 0.002),
        title=f"test accuracy {final:.4f} (all 357 images)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jdp.demo",
        description="Train a small CNN on scikit-learn's handwritten digits with jdp, "
        "on N devices and on 1, and draw what jdp promises.",
    )
    add = parser.add_argument
    add("--devices", type=int, default=8, help="CPU devices to force (default 8); 0 keeps JAX's")
    add("--steps", type=_positive, default=600, help="training steps (default 600)")
    add("--batch-size", type=_positive, default=128, help="global batch, a multiple of devices")
    add("--precision", choices=PRECISIONS, default="float32", help="compute dtype (float32)")
    add("--backend", choices=("pmap", "shard_map"), default="pmap", help="default pmap")
    add("--learning-rate", type=float, default=3e-3, help="peak Adam rate, cosine-decayed")
    add("--eval-every", type=_positive, default=50, help="steps between test evaluations")
    add("--out", type=pathlib.Path, default=pathlib.Path("out/demo"), help="output folder")
    add("--resume", action="store_true", help="continue from the checkpoint in --out")
    add("--no-reference", action="store_true", help="skip the 1-device reference run")
    add(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="exact mode: bitwise equal on 1 and N devices (default: on for float32, "
        "off for bfloat16/float16, whose point is the ordinary mixed-precision step)",
    )
    add("--virtual-replicas", type=_positive, default=8, help="exact mode's G (default 8)")
    add(
        "--communication",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the gradient all-reduce (bfloat16 halves the bytes; not with --exact)",
    )
    add("--seed", type=int, default=0, help="seed for the split, the init and the shuffle")
    add("--quiet", action="store_true", help="no progress bar")
    add(
        "--compilation-cache",
        default="out/jax_cache",
        help="persistent XLA compilation cache folder, reused by later runs ('' disables)",
    )
    args = parser.parse_args(argv)
    if args.exact is None:
        # float32 is the reference mode: it shows 8 devices equal to 1 bit for
        # bit. The ordinary step's rounding differences grow with training
        # (measured: 3.7e-7 after 150 float32 steps, 2.4e-2 after 600).
        args.exact = args.precision == "float32"
    if args.devices < 0:
        parser.error(f"--devices must be >= 0, got {args.devices}")
    if args.exact and args.communication != "float32":
        parser.error(
            "--communication bfloat16 rounds the sum over replicas, which exact mode (on by "
            "default with float32) cannot keep: add --no-exact, or --precision bfloat16"
        )
    return args


def train(args, train_data, test_data, devices, checkpoints=None):
    """Trains the CNN on ``devices``; returns ``(step, state, history, seconds)``."""
    policy, loss_scale = precision_setup(args.precision)
    backend = jdp.pmap if args.backend == "pmap" else jdp.shard_map
    if args.backend == "pmap":
        wrap = lambda step: backend(step, devices=devices)  # noqa: E731
    else:
        wrap = lambda step: backend(step, mesh=jax.sharding.Mesh(np.asarray(devices), ("batch",)))  # noqa: E731
    if args.exact:
        strategy = jdp.strategies.exact(args.virtual_replicas)
    elif args.communication == "bfloat16":
        comm = jdp.strategies.cast_communication(jnp.bfloat16)
        strategy = jdp.strategies.data_parallel(communication=comm)
    else:
        strategy = jdp.strategies.data_parallel()
    train_step = wrap(
        jdp.make_train_step(
            loss_fn,
            has_aux=True,
            precision=policy,
            strategy=strategy,
            metrics=[jdp.metrics.grad_norm()],
        )
    )
    eval_step = wrap(jdp.make_eval_step(metric_fn))
    params = CNN().init(jax.random.key(args.seed), train_data["image"][:1])["params"]
    tx = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    state = train_step.replicate(jdp.TrainState.create(params=params, tx=tx, loss_scale=loss_scale))

    def test_batches():
        return jdp.BatchIterator(
            test_data,
            args.batch_size,
            shuffle=False,
            remainder="pad",
            repeat=False,
            num_devices=len(devices),
        )

    batches = jdp.BatchIterator(
        train_data, args.batch_size, seed=args.seed, num_devices=len(devices)
    )
    start = time.perf_counter()
    state, history = jdp.fit(
        train_step,
        state,
        batches,
        num_steps=args.steps,
        eval_step=eval_step,
        eval_data=test_batches,
        eval_every=args.eval_every,
        checkpointer=checkpoints,
        checkpoint_every=max(args.steps // 4, 1) if checkpoints is not None else None,
        log_every=5,
        progress=not args.quiet,
    )
    seconds = time.perf_counter() - start
    final = jdp.evaluate(eval_step, state, test_batches())
    return train_step.unreplicate(state), history, final, seconds


def main(argv=None) -> dict:
    args = parse_args(argv)
    devices = _set_up(args)
    n = len(devices)
    train_data, test_data = load_splits(args.seed)
    checkpoint_dir = args.out / "checkpoints"
    if checkpoint_dir.exists() and not args.resume:
        shutil.rmtree(checkpoint_dir)
    args.out.mkdir(parents=True, exist_ok=True)

    print(
        f"jdp demo: {len(train_data['label'])} train / {len(test_data['label'])} test digits, "
        f"{n} {jax.default_backend()} devices ({args.backend}), {args.precision} compute"
        f"{' with dynamic loss scaling' if args.precision == 'float16' else ''}, "
        f"global batch {args.batch_size} ({args.batch_size // n} per device), {args.steps} steps"
    )
    if args.exact:
        print(
            f"exact mode: the batch is split into {args.virtual_replicas} virtual replicas "
            "whatever the device count, so the run is bitwise the same on 1 device and on "
            f"{n} (docs/exact.md)"
        )
    with jdp.Checkpointer(checkpoint_dir, max_to_keep=2) as ckpt:
        state, history, final, seconds = train(args, train_data, test_data, devices, ckpt)
        saved = ckpt.all_steps()
    reference = None
    result = _result(args, n, state, history, final)
    trained = result["steps"] - (history.resumed_at[-1] if history.resumed_at else 0)
    result["examples_per_s"] = trained * args.batch_size / seconds
    if not args.no_reference:
        print(f"the same run on 1 device, for comparison ({args.steps} steps)")
        one, reference, one_final, one_seconds = train(args, train_data, test_data, devices[:1])
        # The 1-device run never resumes: it trains every step.
        result["reference_examples_per_s"] = args.steps * args.batch_size / one_seconds
        result["max_param_diff"] = max_difference(state.params, one.params)
        result["bitwise_equal"] = all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(one), strict=True)
            if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
        )
        result["reference_test_accuracy"] = one_final["accuracy"]
    fig = plot_promises(history, reference, result)
    plot = args.out / "promises.png"
    fig.savefig(plot, dpi=90, metadata={"Software": None})  # the same bytes on every run
    result.update(plot=str(plot), checkpoints=str(checkpoint_dir), checkpoint_steps=saved)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    _report(result, seconds)
    return result


def _set_up(args: argparse.Namespace) -> list:
    """Devices, the compilation cache and matplotlib's backend; the devices, checked."""
    if args.devices:
        jdp.force_cpu_devices(args.devices)
    if args.compilation_cache:
        # A second run loads the compiled steps instead of compiling them again
        # (docs/performance.md: the CNN's first step 1.8 s -> 0.5 s).
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import matplotlib

    matplotlib.use("Agg")
    devices = jax.local_devices()
    n = len(devices)
    if args.batch_size % n:
        raise SystemExit(f"--batch-size {args.batch_size} is not a multiple of the {n} devices.")
    if args.exact and (args.virtual_replicas % n or args.batch_size % args.virtual_replicas):
        raise SystemExit(
            f"--exact needs --virtual-replicas ({args.virtual_replicas}) to be a multiple of "
            f"the {n} devices and to divide --batch-size ({args.batch_size})."
        )
    return devices


def _result(args: argparse.Namespace, n: int, state, history, final) -> dict:
    """result.json's fields for the N-device run (the 1-device comparison fills in the rest)."""
    return {
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "test_examples": int(final["weights"]["accuracy"]),
        "steps": int(state.step),
        "skipped_steps": int(state.skipped_steps),
        "devices": n,
        "global_batch": args.batch_size,
        "precision": args.precision,
        "backend": args.backend,
        "steady_examples_per_s": float(np.median([r["examples_per_s"] for r in history.train])),
        "per_replica_loss": _replica_losses(history.train[-1]),
        "resumed_at": history.resumed_at,
        "max_param_diff": None,
        "bitwise_equal": None,
        "exact_mode": args.exact,
        "communication": args.communication,
        "backend_platform": jax.default_backend(),
    }


def _report(result: dict, seconds: float) -> None:
    n = result["devices"]
    print(
        f"trained {result['steps']} steps in {seconds:.1f} s on {n} devices: "
        f"{result['examples_per_s']:,.0f} examples/s over the whole loop (compilation, "
        f"evaluation and checkpoints included), {result['steady_examples_per_s']:,.0f} "
        "examples/s between them"
    )
    if "reference_examples_per_s" in result and result["backend_platform"] == "cpu":
        print(
            f"1 device: {result['reference_examples_per_s']:,.0f} examples/s over its loop. "
            f"The {n} CPU devices share this machine's {os.cpu_count()} cores, so they add "
            "all-reduces and thread switches but no compute; on accelerators each device "
            "brings its own."
        )
    if result["max_param_diff"] is not None:
        same = "bitwise identical state" if result["bitwise_equal"] else "states differ"
        print(
            f"1 device vs {n}: largest parameter difference {result['max_param_diff']:.2e}, "
            f"{same} (test accuracy {result['reference_test_accuracy']:.4f} vs "
            f"{result['test_accuracy']:.4f})"
        )
    losses = result["per_replica_loss"]
    print(f"last per-replica losses: {min(losses):.4f} .. {max(losses):.4f}")
    if result["precision"] == "float16":
        print(
            f"skipped steps: {result['skipped_steps']} (gradient overflows under the loss "
            "scale; every replica skips the same steps)"
        )
    print(
        f"test accuracy {result['test_accuracy']:.4f} on all {result['test_examples']} "
        f"test digits (loss {result['test_loss']:.4f})"
    )
    print(
        f"wrote {result['plot']}, result.json and checkpoints {result['checkpoint_steps']} "
        f"in {result['checkpoints']}"
    )


if __name__ == "__main__":
    main()

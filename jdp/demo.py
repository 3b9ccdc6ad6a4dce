"""The main job: a Flax CNN on real handwritten digits across 8 CPU devices.

    python -m jdp.demo [--devices 8] [--steps 600] [--batch-size 128]
                       [--precision bfloat16] [--backend pmap] [--out out/demo]

scikit-learn's 8x8 digits (1,797 real scans that ship inside scikit-learn, no
download) are split into 1,440 training and 357 test images. The CNN trains
with bfloat16 compute, float32 master weights and dynamic loss scaling,
evaluates exactly on every test image (357 is not a multiple of 8: the last
batch is padded and masked), prints the test accuracy, and writes a PNG of
the loss and accuracy curves plus a checkpoint to the output folder.

The pieces (data, model, losses, plot) are importable for the notebook
``notebooks/04_digits.ipynb``. Importing this module starts no JAX backend.
"""

import argparse
import json
import pathlib
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdp

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
    """Per-example accuracy and loss, for exact evaluation."""
    logits = logits_of(params, batch["image"])
    return {
        "accuracy": (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32),
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]),
    }


def plot_history(history, final_accuracy: float, title: str):
    """A figure with the train/test loss and accuracy curves of a :func:`jdp.fit` run."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    train_steps = [r["step"] for r in history.train]
    eval_steps = [r["step"] for r in history.eval]
    a.plot(train_steps, [r["loss"] for r in history.train], label="train (mean of replicas)")
    a.plot(eval_steps, [r["loss"] for r in history.eval], "o-", label="test")
    b.plot(eval_steps, [r["accuracy"] for r in history.eval], "o-", label="test")
    b.plot(train_steps, [r["accuracy"] for r in history.train], alpha=0.6, label="train batch")
    a.set(xlabel="step", ylabel="loss", yscale="log", title="loss")
    b.set(
        xlabel="step",
        ylabel="accuracy",
        ylim=(0, 1.01),
        title=f"test accuracy {final_accuracy:.4f}",
    )
    a.legend()
    b.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jdp.demo",
        description="Train a small CNN on scikit-learn's handwritten digits with jdp.",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="CPU devices to force (default 8); 0 keeps JAX's own devices",
    )
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="global batch size, a multiple of the device count (default 128)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bfloat16",
        help="compute dtype (default bfloat16; 16-bit runs use dynamic loss scaling)",
    )
    parser.add_argument(
        "--backend",
        choices=("pmap", "shard_map"),
        default="pmap",
        help="how the step runs (default pmap)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=3e-3,
        help="peak Adam learning rate, cosine-decayed (default 3e-3)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=50, help="steps between test evaluations (default 50)"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("out/demo"),
        help="output folder (default out/demo)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out instead of starting over",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for the split, the init and the shuffle"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.devices:
        jdp.force_cpu_devices(args.devices)
    import matplotlib

    matplotlib.use("Agg")

    n = jax.local_device_count()
    if args.batch_size % n:
        sys.exit(f"--batch-size {args.batch_size} is not a multiple of the {n} devices.")
    train, test = load_splits(args.seed)

    dtype = None if args.precision == "float32" else getattr(jnp, args.precision)
    backend = jdp.pmap if args.backend == "pmap" else jdp.shard_map
    train_step = backend(jdp.make_train_step(loss_fn, has_aux=True, compute_dtype=dtype))
    eval_step = backend(jdp.make_eval_step(metric_fn))
    params = CNN().init(jax.random.key(args.seed), train["image"][:1])["params"]
    state = train_step.replicate(
        jdp.TrainState.create(
            params=params,
            tx=optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps)),
            loss_scale=None if dtype is None else jdp.DynamicLossScale(jnp.float32(2.0**15)),
        )
    )

    checkpoints = args.out / "checkpoints"
    if checkpoints.exists() and not args.resume:
        shutil.rmtree(checkpoints)
    args.out.mkdir(parents=True, exist_ok=True)

    def test_batches():
        return jdp.BatchIterator(
            test, args.batch_size, shuffle=False, remainder="pad", repeat=False
        )

    print(
        f"jdp demo: {len(train['label'])} train / {len(test['label'])} test digits, {n} "
        f"{jax.default_backend()} devices ({args.backend}), {args.precision} compute, "
        f"global batch {args.batch_size}, {args.steps} steps"
    )
    with jdp.Checkpointer(checkpoints, max_to_keep=2) as ckpt:
        state, history = jdp.fit(
            train_step,
            state,
            jdp.BatchIterator(train, args.batch_size, seed=args.seed),
            num_steps=args.steps,
            eval_step=eval_step,
            eval_data=test_batches,
            eval_every=args.eval_every,
            checkpointer=ckpt,
            checkpoint_every=max(args.steps // 4, 1),
            progress=not args.quiet,
        )
        saved = ckpt.all_steps()
    state, final = jdp.evaluate(eval_step, state, test_batches())
    skipped = int(jdp.unreplicate(state).skipped_steps)

    fig = plot_history(
        history, final["accuracy"], f"jdp: CNN on digits, {n} devices, {args.precision}"
    )
    plot = args.out / "curves.png"
    fig.savefig(plot, dpi=100)
    result = {
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "test_examples": final["count"],
        "steps": int(jdp.unreplicate(state).step),
        "skipped_steps": skipped,
        "devices": n,
        "precision": args.precision,
        "plot": str(plot),
        "checkpoints": str(checkpoints),
        "checkpoint_steps": saved,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(
        f"test accuracy {final['accuracy']:.4f} on all {final['count']} test digits "
        f"(loss {final['loss']:.4f}, {skipped} skipped steps)"
    )
    print(f"wrote {plot}, {args.out / 'result.json'} and checkpoints {saved} in {checkpoints}")
    return result


if __name__ == "__main__":
    main()

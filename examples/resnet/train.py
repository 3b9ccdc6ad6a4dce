"""A ResNet image classifier on scikit-learn's handwritten digits.

    python examples/resnet/train.py --out out/resnet [--size resnet18] [--strategy fsdp]

The data are scikit-learn's 1,797 real 8x8 digit scans (they ship inside
scikit-learn: nothing to download), split into 1,440 training and 357 test
images as in ``python -m jdp.demo``, optionally upsampled (``--image-size``).
Evaluation is exact: every test image counts once (the last batch is padded
and the padding left out).

The model is ResNet v1.5 in Flax Linen, with two changes for small images and
for data parallelism: the stem is one 3x3 convolution without max pooling (as
for CIFAR), and GroupNorm replaces BatchNorm (as in BiT), so the training state
is the parameters alone and no batch statistics cross replicas. ``--size``
picks the depth: ``resnet18`` and ``resnet34`` with basic blocks, ``resnet50``
with bottleneck blocks (23.5M parameters for 10 classes). Each residual block
is applied through ``jdp.strategies.layer``, so ``--strategy fsdp`` gathers
one block's parameters at a time.
"""

import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import common

# (blocks per stage, width of the first stage, bottleneck blocks)
SIZES = {
    "tiny": ((1, 1), 16, False),
    "resnet18": ((2, 2, 2, 2), 64, False),
    "resnet34": ((3, 4, 6, 3), 64, False),
    "resnet50": ((3, 4, 6, 3), 64, True),
}
GROUPS = 8  # GroupNorm's groups; every width is a multiple of 8


def digits(image_size: int, seed: int = 0):
    """``(train, test)`` dicts of ``image`` (N, S, S, 1) and ``label``, the demo's split."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)
    if image_size != 8:
        import jax

        images = np.asarray(
            jax.image.resize(images, (len(images), image_size, image_size), "linear")
        )
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    train, test = order[:1440], order[1440:]
    return (
        {"image": images[train, ..., None], "label": labels[train]},
        {"image": images[test, ..., None], "label": labels[test]},
    )


def model(size: str, image_size: int):
    """``(init, loss_fn, metric_fn)`` for a model size."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import jdp

    stages, width, bottleneck = SIZES[size]

    class Block(nn.Module):
        features: int
        strides: int

        @nn.compact
        def __call__(self, x):
            norm = functools.partial(nn.GroupNorm, num_groups=GROUPS)
            if bottleneck:
                y = nn.relu(norm()(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
                y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(y)
                y = nn.relu(norm()(y))
                y = norm()(nn.Conv(self.features * 4, (1, 1), use_bias=False)(y))
            else:
                y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
                y = nn.relu(norm()(y))
                y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
            if x.shape != y.shape:  # a projection where the shape changes
                x = nn.Conv(y.shape[-1], (1, 1), self.strides, use_bias=False)(x)
                x = norm()(x)
            return nn.relu(x + y)

    # Each block's (features, strides): stages after the first halve the image.
    config = [
        (width * 2**stage, 2 if stage > 0 and i == 0 else 1)
        for stage, count in enumerate(stages)
        for i in range(count)
    ]

    def apply_block(features, strides, p, x):
        return Block(features, strides).apply({"params": p}, x)

    def logits(params, images):
        x = nn.Conv(width, (3, 3), use_bias=False).apply({"params": params["stem"]}, images)
        x = nn.relu(nn.GroupNorm(GROUPS).apply({"params": params["stem_norm"]}, x))
        for (features, strides), block in zip(config, params["blocks"], strict=True):
            x = jdp.strategies.layer(functools.partial(apply_block, features, strides))(block, x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10).apply({"params": params["head"]}, x).astype(jnp.float32)

    def per_example(params, batch):
        cross = optax.softmax_cross_entropy_with_integer_labels
        out = logits(params, batch["image"])
        return cross(out, batch["label"]), jnp.argmax(out, -1) == batch["label"]

    def loss_fn(params, batch):
        return per_example(params, batch)[0].mean()

    def metric_fn(params, batch):
        loss, correct = per_example(params, batch)
        return {
            "loss": jdp.weighted_mean(loss, batch["mask"]),
            "accuracy": jdp.weighted_mean(correct, batch["mask"]),
        }

    def init(seed: int):
        keys = iter(jax.random.split(jax.random.key(seed), len(config) + 3))
        x = jnp.zeros((1, image_size, image_size, 1))
        stem = nn.Conv(width, (3, 3), use_bias=False)
        params = {"stem": stem.init(next(keys), x)["params"]}
        x = stem.apply({"params": params["stem"]}, x)
        params["stem_norm"] = nn.GroupNorm(GROUPS).init(next(keys), x)["params"]
        params["blocks"] = []
        for features, strides in config:
            block = Block(features, strides)
            params["blocks"].append(block.init(next(keys), x)["params"])
            x = block.apply({"params": params["blocks"][-1]}, x)
        params["head"] = nn.Dense(10).init(next(keys), x.mean(axis=(1, 2)))["params"]
        return params

    return init, loss_fn, metric_fn


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="resnet18")
    p.add_argument("--image-size", type=int, default=32, help="digits upsampled to this size")
    args = p.parse_args(argv)
    common.start(args)
    train, test = digits(args.image_size, args.seed)
    init, loss_fn, metric_fn = model(args.size, args.image_size)
    return common.train(
        args,
        loss_fn=loss_fn,
        metric_fn=metric_fn,
        params=init(args.seed),
        train_split=train,
        test_split=test,
        layers=common.in_blocks,
    )


if __name__ == "__main__":
    main()

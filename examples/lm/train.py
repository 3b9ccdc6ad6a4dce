"""A GPT-style causal language model on the Python standard library's own sources.

    python examples/lm/train.py --out out/lm [--size small] [--strategy fsdp]

The corpus is every top-level ``.py`` file of the standard library of the
Python running this script (about 4.7 MB for Python 3.11; nothing to
download), read as bytes: the vocabulary is the 256 byte values. The last 5%
is held out for evaluation, reported as the loss in nats per byte. The model is a pre-norm decoder-only transformer in Flax Linen with
tied input and output embeddings; ``--size gpt2`` is GPT-2 small's shape.

Each block is applied through ``jdp.strategies.layer``, the one line that
lets ``--strategy fsdp`` gather one block's parameters at a time; under the
other strategies it is the plain function.
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import common

# (layers, width, heads, context): "gpt2" is GPT-2 small's shape. With 256 byte
# tokens its embedding is 0.2M of its 86M parameters (GPT-2's 50,257-token one
# is 39M of its 124M).
SIZES = {
    "tiny": (2, 64, 4, 64),
    "small": (6, 256, 8, 256),
    "medium": (8, 512, 8, 512),
    "gpt2": (12, 768, 12, 1024),
}
HELD_OUT = 0.05


def corpus() -> bytes:
    """The standard library's top-level sources, in sorted order, as one byte string."""
    root = pathlib.Path(os.__file__).parent
    return b"".join(path.read_bytes() for path in sorted(root.glob("*.py")))


def windows(data: bytes, context: int):
    """``(train, test)`` dicts of ``tokens``: non-overlapping windows of context + 1 bytes."""
    import numpy as np

    tokens = np.frombuffer(data, np.uint8).astype(np.int32)
    split = int(len(tokens) * (1 - HELD_OUT))

    def cut(part):
        count = len(part) // (context + 1)
        return {"tokens": part[: count * (context + 1)].reshape(count, context + 1)}

    return cut(tokens[:split]), cut(tokens[split:])


def model(size: str):
    """``(init, loss_fn, metric_fn)`` for a model size."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import jdp

    layers, width, heads, context = SIZES[size]

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            causal = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(h, mask=causal)
            h = nn.Dense(4 * width)(nn.LayerNorm()(x))
            return x + nn.Dense(width)(nn.gelu(h))

    def apply_block(p, x):
        return Block().apply({"params": p}, x)

    def logits(params, inputs):
        x = params["embed"][inputs] + params["position"][: inputs.shape[1]]
        for block in params["blocks"]:
            x = jdp.strategies.layer(apply_block)(block, x)
        x = nn.LayerNorm().apply({"params": params["final_norm"]}, x)
        return (x @ params["embed"].T).astype(jnp.float32)

    def per_sequence(params, batch):
        tokens = batch["tokens"]
        cross = optax.softmax_cross_entropy_with_integer_labels
        return cross(logits(params, tokens[:, :-1]), tokens[:, 1:]).mean(-1)

    def loss_fn(params, batch):
        return per_sequence(params, batch).mean()

    def metric_fn(params, batch):
        return {"loss": jdp.weighted_mean(per_sequence(params, batch), batch["mask"])}

    def init(seed: int):
        keys = jax.random.split(jax.random.key(seed), layers + 2)
        sample = jnp.zeros((1, context, width))
        return {
            "embed": 0.02 * jax.random.normal(keys[0], (256, width)),
            "position": 0.02 * jax.random.normal(keys[1], (context, width)),
            "blocks": [Block().init(k, sample)["params"] for k in keys[2:]],
            "final_norm": nn.LayerNorm().init(keys[0], sample)["params"],
        }

    return init, loss_fn, metric_fn


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument(
        "--corpus-bytes", type=int, default=None, help="use only the corpus's first this many"
    )
    args = p.parse_args(argv)
    common.start(args)
    train, test = windows(corpus()[: args.corpus_bytes], SIZES[args.size][3])
    init, loss_fn, metric_fn = model(args.size)
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

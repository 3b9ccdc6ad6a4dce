"""The exact-mode model zoo: every model family researchers train, as check_exact inputs.

Each family is a function returning ``(make_step, state, batches)`` for
:func:`jdp.testing.check_exact`: a few steps of a small model on fixed data.
tests/test_zoo.py runs every family on 1, 2, 4 and 8 devices under both
backends; tests/scripts/multiprocess_zoo.py runs them on 2 processes x 2 devices
(``ACROSS_PROCESSES``). The ``*_split_optimizer`` families train a family with
its optimizer state split over the devices (``exact(G, shard_optimizer_state=True)``).
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jdp
import jdp.nnx
from tests import models

G = 8  # virtual replicas
STEPS = 3


def _exact(loss_fn, shard=False, **kwargs) -> Callable[[], jdp.TrainStep]:
    strategy = jdp.strategies.exact(G, shard_optimizer_state=shard)
    return lambda: jdp.make_train_step(loss_fn, strategy=strategy, **kwargs)


def mlp():
    """An MLP with dropout; Adam behind a global-norm clip."""
    r = np.random.RandomState(0)
    params = {
        "w1": jnp.asarray(r.randn(6, 32) / 3, jnp.float32),
        "b1": jnp.zeros(32, jnp.float32),
        "w2": jnp.asarray(r.randn(32, 3) / 6, jnp.float32),
    }

    def loss_fn(p, batch, rng):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        h = jnp.where(jax.random.bernoulli(rng, 0.9, h.shape), h / 0.9, 0.0)
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    state = jdp.TrainState.create(params=params, tx=tx, rng=jax.random.key(0))
    batches = [
        {"x": r.randn(64, 6).astype(np.float32), "y": r.randn(64, 3).astype(np.float32)}
        for _ in range(STEPS)
    ]
    return _exact(loss_fn, has_rng=True), state, batches


class ConvNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> Conv -> pool -> Dropout -> Dense."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
        x = nn.Dropout(0.25, deterministic=not train)(x.mean(axis=(1, 2)))
        return nn.Dense(10)(x)


def cnn(shard=False):
    """A CNN with batch norm and dropout; SGD with momentum under a dynamic loss scale."""
    r = np.random.RandomState(1)
    variables = ConvNet().init(jax.random.key(1), jnp.zeros((1, 8, 8, 1)), train=False)

    def loss_fn(params, batch, model_state, rng):
        logits, updates = ConvNet().apply(
            {"params": params, "batch_stats": model_state},
            batch["image"],
            train=True,
            rngs={"dropout": rng},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return loss.mean(), updates["batch_stats"]

    state = jdp.TrainState.create(
        params=variables["params"],
        tx=optax.sgd(0.05, momentum=0.9),
        model_state=variables["batch_stats"],
        rng=jax.random.key(2),
        loss_scale=jdp.DynamicLossScale(jnp.float32(2.0**12), period=2),
    )
    batches = [
        {
            "image": r.randn(32, 8, 8, 1).astype(np.float32),
            "label": r.randint(0, 10, 32).astype(np.int32),
        }
        for _ in range(STEPS)
    ]
    return _exact(loss_fn, shard, has_model_state=True, has_rng=True), state, batches


VOCAB, LENGTH, WIDTH = 64, 16, 64


class Block(nn.Module):
    """Pre-norm causal self-attention (4 heads, dropout) and a GELU MLP."""

    @nn.compact
    def __call__(self, x, mask, train: bool):
        # SelfAttention's successor (Flax deprecates SelfAttention): the same computation.
        h = nn.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=WIDTH, dropout_rate=0.1, deterministic=not train
        )(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(0.1, deterministic=not train)(h)
        h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(h))


class LM(nn.Module):
    """A 2-layer causal transformer LM: token embedding + learned positions."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        positions = self.param("positions", nn.initializers.normal(0.02), (LENGTH, WIDTH))
        x = nn.Embed(VOCAB, WIDTH)(tokens) + positions[: tokens.shape[1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(2):
            x = Block()(x, mask, train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def lm_batches(count, size=32, seed=2):
    """Token sequences of random length, padded to LENGTH + 1 (``valid`` marks real targets)."""
    r = np.random.RandomState(seed)
    out = []
    for _ in range(count):
        lengths = r.randint(4, LENGTH + 1, size)
        out.append(
            {
                "tokens": r.randint(1, VOCAB, (size, LENGTH + 1)).astype(np.int32),
                "valid": np.arange(LENGTH)[None] < lengths[:, None],
            }
        )
    return out


def lm_loss(params, batch, rng):
    """Per-token cross-entropy over the real tokens of padded sequences."""
    logits = LM().apply(
        {"params": params}, batch["tokens"][:, :-1], train=True, rngs={"dropout": rng}
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return jdp.weighted_mean(loss, batch["valid"])


def transformer(shard=False):
    """The causal LM with dropout and a per-token WeightedLoss; AdamW."""
    params = LM().init(jax.random.key(3), jnp.zeros((1, LENGTH), jnp.int32))["params"]
    state = jdp.TrainState.create(
        params=params, tx=optax.adamw(1e-3, weight_decay=0.01), rng=jax.random.key(4)
    )
    return _exact(lm_loss, shard, has_rng=True), state, lm_batches(STEPS)


def nnx_model():
    """An NNX model with batch norm and dropout; plain SGD."""
    graphdef, params, model_state = jdp.nnx.split(models.NnxNet(nnx.Rngs(5)))

    def loss_fn(p, batch, model_state, rng):
        model = jdp.nnx.merge(graphdef, p, model_state, rng=rng)
        model.train()
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, jdp.nnx.state(model, model_state)

    state = jdp.TrainState.create(
        params=params, tx=optax.sgd(0.1), model_state=model_state, rng=jax.random.key(6)
    )
    r = np.random.RandomState(7)
    batches = [
        {"x": r.randn(32, 6).astype(np.float32), "label": r.randint(0, 4, 32).astype(np.int32)}
        for _ in range(STEPS)
    ]
    return _exact(loss_fn, has_model_state=True, has_rng=True), state, batches


def moe_counter():
    """Top-k routing whose bias comes from int32 expert-usage counts kept in model state."""
    r = np.random.RandomState(3)
    experts = 4
    params = {
        "router": jnp.asarray(r.randn(6, experts) / 3, jnp.float32),
        "experts": jnp.asarray(r.randn(experts, 6, 3) / 3, jnp.float32),
    }

    def loss_fn(p, batch, model_state):
        counts = model_state["usage"]
        # Experts used more are routed to less: the count changes the loss.
        bias = -0.1 * counts.astype(jnp.float32) / (1.0 + jnp.sum(counts))
        scores = batch["x"] @ p["router"] + bias
        _, top = jax.lax.top_k(scores, 2)
        chosen = jax.nn.one_hot(top, experts).sum(1)  # (b, experts)
        gates = jax.nn.softmax(jnp.where(chosen > 0, scores, -1e9))
        out = jnp.einsum("be,bi,eio->bo", gates, batch["x"], p["experts"])
        usage = counts + chosen.sum(0).astype(jnp.int32)
        return jnp.mean((out - batch["y"]) ** 2), {"usage": usage}

    state = jdp.TrainState.create(
        params=params, tx=optax.adam(1e-2), model_state={"usage": jnp.zeros(experts, jnp.int32)}
    )
    batches = [
        {"x": r.randn(64, 6).astype(np.float32), "y": r.randn(64, 3).astype(np.float32)}
        for _ in range(STEPS)
    ]
    return _exact(loss_fn, has_model_state=True), state, batches


def weight_zero_step():
    """Batch norm under a WeightedLoss with one all-padding step (global weight 0)."""
    variables = models.Classifier().init(jax.random.key(4), jnp.zeros((1, 6)), train=False)

    def loss_fn(params, batch, model_state, rng):
        logits, updates = models.Classifier().apply(
            {"params": params, "batch_stats": model_state},
            batch["x"],
            train=True,
            rngs={"dropout": rng},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return jdp.weighted_mean(loss, batch["real"]), updates["batch_stats"]

    r = np.random.RandomState(4)
    batches = []
    for i in range(STEPS + 1):
        real = np.ones(64, bool) if i != 1 else np.zeros(64, bool)
        batches.append(
            {
                "x": r.randn(64, 6).astype(np.float32),
                "label": r.randint(0, 4, 64).astype(np.int32),
                "real": real,
            }
        )
    state = jdp.TrainState.create(
        params=variables["params"],
        tx=optax.sgd(0.1, momentum=0.9),
        model_state=variables["batch_stats"],
        rng=jax.random.key(5),
    )
    return _exact(loss_fn, has_model_state=True, has_rng=True), state, batches


def _classes(count, shape, classes, seed):
    r = np.random.RandomState(seed)
    return [
        {
            "x": r.randn(32, *shape).astype(np.float32),
            "label": r.randint(0, classes, 32).astype(np.int32),
        }
        for _ in range(count)
    ]


def classifier_loss(module):
    def loss_fn(params, batch):
        logits = module.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn


class ViT(nn.Module):
    """A strided-conv patch embedding, a CLS token, one attention block, a head on CLS."""

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(32, (4, 4), strides=(4, 4), padding="VALID")(images)  # 8x8 -> 2x2 patches
        x = x.reshape(x.shape[0], -1, 32)
        cls = self.param("cls", nn.initializers.normal(0.02), (1, 1, 32))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, 32)), x], axis=1)
        x = x + self.param("positions", nn.initializers.normal(0.02), x.shape[1:])
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
        x = x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
        return nn.Dense(5)(nn.LayerNorm()(x[:, 0]))


def vit():
    """ViT; AdamW with a warmup-cosine schedule and a weight-decay mask (no decay on 1-D leaves)."""
    params = ViT().init(jax.random.key(8), jnp.zeros((1, 8, 8, 3)))["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 10)
    mask = jax.tree.map(lambda x: x.ndim > 1, params)
    tx = optax.adamw(schedule, weight_decay=0.05, mask=mask)
    state = jdp.TrainState.create(params=params, tx=tx)
    return _exact(classifier_loss(ViT())), state, _classes(STEPS, (8, 8, 3), 5, 9)


class Recurrent(nn.Module):
    """An LSTM through nn.RNN (a scan over time) and a GRU on top; a head on the last state."""

    @nn.compact
    def __call__(self, x):
        x = nn.RNN(nn.OptimizedLSTMCell(16))(x)
        x = nn.RNN(nn.GRUCell(16))(x)
        return nn.Dense(4)(x[:, -1])


def scanned_rnn():
    """LSTM + GRU over 6 time steps; Adafactor."""
    params = Recurrent().init(jax.random.key(10), jnp.zeros((1, 6, 5)))["params"]
    state = jdp.TrainState.create(params=params, tx=optax.adafactor(1e-2))
    return _exact(classifier_loss(Recurrent())), state, _classes(STEPS, (6, 5), 4, 11)


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(24)(nn.gelu(nn.Dense(48)(nn.LayerNorm()(x)))), None


class RematScan(nn.Module):
    """Three residual blocks: nn.remat inside nn.scan, parameters stacked over the blocks."""

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            nn.remat(Residual),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = blocks()(nn.Dense(24)(x), None)
        return nn.Dense(4)(x)


def remat_scan():
    """nn.remat + nn.scan over blocks; LAMB."""
    params = RematScan().init(jax.random.key(12), jnp.zeros((1, 7)))["params"]
    state = jdp.TrainState.create(params=params, tx=optax.lamb(3e-3))
    return _exact(classifier_loss(RematScan())), state, _classes(STEPS, (7,), 4, 13)


class UNet(nn.Module):
    """GroupNorm, RMSNorm, a depthwise conv, a strided conv down, a transposed conv up, a skip."""

    @nn.compact
    def __call__(self, x):
        skip = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(8, (3, 3))(x)))
        h = nn.Conv(8, (3, 3), feature_group_count=8)(skip)  # depthwise
        h = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(h))
        h = nn.RMSNorm()(h)
        h = nn.ConvTranspose(8, (2, 2), strides=(2, 2))(h)
        h = nn.Conv(1, (1, 1))(jnp.concatenate([h, skip], axis=-1))
        return h[..., 0]


def unet():
    """A U-Net regressing a denoised image; SGD with Nesterov momentum under optax.MultiSteps(2)."""
    params = UNet().init(jax.random.key(14), jnp.zeros((1, 8, 8, 1)))["params"]
    tx = optax.MultiSteps(optax.sgd(0.05, momentum=0.9, nesterov=True), every_k_schedule=2)
    r = np.random.RandomState(15)
    batches = []
    for _ in range(STEPS + 1):
        clean = r.rand(32, 8, 8).astype(np.float32)
        noisy = clean + 0.1 * r.randn(32, 8, 8).astype(np.float32)
        batches.append({"x": noisy[..., None], "y": clean})

    def loss_fn(params, batch):
        return jnp.mean((UNet().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return _exact(loss_fn), jdp.TrainState.create(params=params, tx=tx), batches


def tied_embeddings():
    """Input and output share one embedding table; label smoothing; a scatter-add of counts; Lion."""
    r = np.random.RandomState(16)
    vocab, width = 32, 16
    params = {
        "embed": jnp.asarray(r.randn(vocab, width) / 4, jnp.float32),
        "mix": jnp.asarray(r.randn(width, width) / 4, jnp.float32),
    }

    def loss_fn(p, batch):
        tokens, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        h = jnp.tanh(p["embed"][tokens] @ p["mix"])  # a gather; its gradient is a scatter-add
        logits = h @ p["embed"].T  # the same table, tied
        # Rare targets weigh more: counts by scatter-add over this replica's tokens.
        counts = jnp.zeros(vocab).at[targets.reshape(-1)].add(1.0)
        weights = 1.0 / jnp.sqrt(1.0 + counts[targets])
        labels = optax.smooth_labels(jax.nn.one_hot(targets, vocab), 0.1)
        loss = optax.softmax_cross_entropy(logits, labels) * weights
        return jdp.WeightedLoss(jnp.sum(loss), jnp.float32(loss.size))

    batches = [{"tokens": r.randint(0, vocab, (32, 9)).astype(np.int32)} for _ in range(STEPS)]
    state = jdp.TrainState.create(params=params, tx=optax.lion(1e-3))
    return _exact(loss_fn), state, batches


FAMILIES = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "nnx": nnx_model,
    "moe_counter": moe_counter,
    "weight_zero_step": weight_zero_step,
    "vit": vit,
    "scanned_rnn": scanned_rnn,
    "remat_scan": remat_scan,
    "unet": unet,
    "tied_embeddings": tied_embeddings,
    "cnn_split_optimizer": functools.partial(cnn, shard=True),
    "transformer_split_optimizer": functools.partial(transformer, shard=True),
}

# What tests/scripts/multiprocess_zoo.py trains across processes: every family under
# the lead backend; under pmap the first six, which already cover what processes
# change (the collectives between them, the per-process batch rows, the model state
# rules), to keep the suite's slowest test in bounds.
ACROSS_PROCESSES = {
    "shard_map": sorted(FAMILIES),
    "pmap": ["cnn", "mlp", "moe_counter", "nnx", "transformer", "weight_zero_step"],
}

"""Small models and reference training loops shared by the tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
}


def mlp_params(seed=0, din=6, hidden=16, dout=3):
    r = np.random.RandomState(seed)
    return {
        "w1": jnp.asarray(r.randn(din, hidden) / np.sqrt(din), jnp.float32),
        "b1": jnp.zeros(hidden, jnp.float32),
        "w2": jnp.asarray(r.randn(hidden, dout) / np.sqrt(hidden), jnp.float32),
    }


def mlp_forward(params, batch):
    return jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]


def mlp_loss(params, batch):
    return jnp.mean((mlp_forward(params, batch) - batch["y"]) ** 2)


def regression_batch(size, seed=1, din=6, dout=3):
    r = np.random.RandomState(seed)
    return {
        "x": r.randn(size, din).astype(np.float32),
        "y": r.randn(size, dout).astype(np.float32),
    }


class Classifier(nn.Module):
    """Dense -> BatchNorm -> ReLU -> Dropout -> Dense."""

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4)(x)


class NnxNet(nnx.Module):
    """Flax NNX: Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def classifier_variables(seed=0, din=6):
    return Classifier().init(jax.random.key(seed), jnp.zeros((1, din)), train=False)


def classification_batch(size, seed=2, din=6):
    r = np.random.RandomState(seed)
    return {
        "x": r.randn(size, din).astype(np.float32),
        "label": r.randint(0, 4, size).astype(np.int32),
    }


def classifier_eval_mode_loss(params, batch, model_state):
    """Batch norm on running averages and dropout off: per-example independent."""
    logits = Classifier().apply(
        {"params": params, "batch_stats": model_state}, batch["x"], train=False
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, model_state


def classifier_train_loss(params, batch, model_state, rng):
    logits, updates = Classifier().apply(
        {"params": params, "batch_stats": model_state},
        batch["x"],
        train=True,
        rngs={"dropout": rng},
        mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, updates["batch_stats"]


def train_single_device(loss_fn, params, tx, batches, model_state=None):
    """Plain single-device training on the global batches: the reference."""

    @jax.jit
    def step(params, opt_state, model_state, batch):
        if model_state is None:
            grads = jax.grad(loss_fn)(params, batch)
        else:
            grads, model_state = jax.grad(loss_fn, has_aux=True)(params, batch, model_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state

    opt_state = tx.init(params)
    for batch in batches:
        params, opt_state, model_state = step(params, opt_state, model_state, batch)
    return params, opt_state


def devices(n):
    return jax.local_devices()[:n]


def backend(name, step, n, **kwargs):
    """Wraps ``step`` with backend ``name`` on the first ``n`` devices."""
    import jdp

    if name == "pmap":
        return jdp.pmap(step, devices=devices(n), **kwargs)
    mesh = jax.sharding.Mesh(np.asarray(devices(n)), ("batch",))
    return jdp.shard_map(step, mesh=mesh, **kwargs)


def assert_trees_close(actual, expected, rtol=1e-5, atol=0.0):
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def train_parallel(step_fn, state, data, backend_name, n):
    """Trains ``state`` on ``data`` with backend ``backend_name`` on n devices; checks sync."""
    import jdp

    step = backend(backend_name, step_fn, n)
    state = step.replicate(state)
    metrics = None
    for batch in data:
        state, metrics = step(state, step.shard(batch))
    jdp.assert_replicas_in_sync(state)
    return step.unreplicate(state), metrics


def launch(script, processes, devices, *args, timeout=240):
    """Runs ``python -m jdp.launch`` with ``script`` (in tests/) and its args; asserts success."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(root)
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", str(processes)]
    cmd += ["--devices-per-process", str(devices), str(root / "tests" / "scripts" / script)]
    run = subprocess.run(
        cmd + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-3000:]


def run_killable(cmd, env, kill_after=None, timeout=120):
    """Runs ``cmd``, reading its output lines; SIGKILLs it after the line ``step {kill_after}``.

    Returns ``(returncode, lines, stderr)``.
    """
    import signal
    import subprocess
    import tempfile

    lines = []
    with tempfile.TemporaryFile("w+") as stderr:
        with subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        ) as proc:
            for line in proc.stdout:
                lines.append(line.strip())
                if kill_after is not None and line.strip() == f"step {kill_after}":
                    proc.send_signal(signal.SIGKILL)
                    break
            proc.wait(timeout=timeout)
        stderr.seek(0)
        return proc.returncode, lines, stderr.read()


def lm_params(layers=2, d=16, vocab=32, seq=8, seed=0):
    """A decoder-only transformer LM in plain JAX: a list of blocks between embeddings."""
    r = np.random.RandomState(seed)

    def dense(a, b):
        return jnp.asarray(r.randn(a, b) / np.sqrt(a), jnp.float32)

    block = lambda: {  # noqa: E731
        "ln": jnp.ones(d, jnp.float32),
        "qkv": dense(d, 3 * d),
        "out": dense(d, d),
        "up": dense(d, 4 * d),
        "down": dense(4 * d, d),
    }
    return {
        "embed": dense(vocab, d),
        "pos": jnp.asarray(r.randn(seq, d) * 0.02, jnp.float32),
        "blocks": [block() for _ in range(layers)],
        "head": dense(d, vocab),
    }


def _norm(x, scale):
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * scale


def lm_block(p, x):
    """One pre-norm block: causal self-attention (2 heads) and an MLP."""
    length, d = x.shape[-2], x.shape[-1]
    q, k, v = jnp.split(_norm(x, p["ln"]) @ p["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(*t.shape[:-1], 2, d // 2).swapaxes(-2, -3)  # noqa: E731
    logits = heads(q) @ heads(k).swapaxes(-1, -2) / np.sqrt(d // 2)
    causal = jnp.tril(jnp.ones((length, length), bool))
    attn = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1) @ heads(v)
    x = x + attn.swapaxes(-2, -3).reshape(x.shape) @ p["out"]
    return x + jax.nn.gelu(_norm(x, p["ln"]) @ p["up"]) @ p["down"]


def lm_loss(params, batch):
    """Next-token cross-entropy; each block runs through jdp.strategies.layer."""
    import jdp  # the models module is imported before jdp in some scripts

    tokens = batch["tokens"]
    x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
    for block in params["blocks"]:
        x = jdp.strategies.layer(lm_block)(block, x)
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def stacked(params):
    """:func:`lm_params` with its blocks stacked on a leading layer axis, as a scan keeps them."""
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])}


def lm_scan_loss(params, batch):
    """:func:`lm_loss` over :func:`stacked` params: the blocks run in a ``jax.lax.scan``."""
    import jdp

    tokens = batch["tokens"]
    x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]

    def body(x, block):
        return jdp.strategies.layer(lm_block)(block, x), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def lm_batch(size, seed=3, vocab=32, seq=8):
    r = np.random.RandomState(seed)
    return {"tokens": r.randint(0, vocab, (size, seq + 1)).astype(np.int32)}


def in_blocks(path):
    """``fsdp(layers=...)`` for :func:`lm_params`: the blocks gather themselves."""
    return path.startswith("['blocks']")


def compiled_peak(memory) -> int:
    """XLA's compiled per-device estimate: arguments + outputs + temporaries - donated aliases."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )

"""`make bench`: what exact mode costs on a CNN and a transformer, against the ordinary step.

For the demo's CNN (global batch 128, 8x8 digits), the model zoo's causal
LM (2 layers, 4 heads, d=64, 128 sequences of 16 tokens, dropout, per-token
WeightedLoss) and the zoo's scanned models (an LSTM + GRU over 6 steps;
nn.remat inside nn.scan over 3 blocks; 128 examples), on n = 1 and 8 CPU
devices under jdp.pmap, it times:

  ordinary  jdp.make_train_step(loss)                                  (reference)
  exact     jdp.make_train_step(loss, strategy=jdp.strategies.exact(8))

Rounds are interleaved (ordinary, exact, ordinary, ...) so machine noise hits
both alike; each figure is the median over rounds of the mean step time of
``--steps`` calls. The ratio is exact/ordinary step time (goals: <= 2 for the
CNN, <= 1.5 for the LM and the scanned models). Compile time is the first call's.

Then, for the recurrent model on one device, the floor under exact mode's
cost: its 8 virtual replicas' gradients computed one after another with
nothing else (``lax.map``), against the whole batch's gradient; and why
they are not batched with ``vmap``: how many shapes of a plain sum over the
batch axis round differently when 8 micro-batches are summed in one
operation than when 1, 2 or 4 are (what a device holding fewer would run).

Usage: python benchmarks/exact_cost.py [--rounds 5] [--steps 20] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np
import optax

import jdp
from jdp import demo

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from tests import zoo


def cnn():
    train, _ = demo.load_splits(0)
    params = demo.CNN().init(jax.random.key(0), train["image"][:1])["params"]
    batch = {"image": train["image"][:128], "label": train["label"][:128]}
    make = lambda strategy: jdp.make_train_step(demo.loss_fn, has_aux=True, strategy=strategy)  # noqa: E731
    return make, jdp.TrainState.create(params=params, tx=optax.adam(1e-3)), batch


def lm():
    _, state, _ = zoo.transformer()
    make = lambda strategy: jdp.make_train_step(zoo.lm_loss, has_rng=True, strategy=strategy)  # noqa: E731
    return make, state, zoo.lm_batches(1, size=128)[0]


def _zoo_classifier(family, module):
    def build():
        _, state, batches = zoo.FAMILIES[family]()
        batch = jax.tree.map(lambda x: np.concatenate([x] * 4), batches[0])  # 128 examples
        loss = zoo.classifier_loss(module)
        return lambda strategy: jdp.make_train_step(loss, strategy=strategy), state, batch

    return build


MODELS = {
    "CNN (demo)": cnn,
    "causal LM (zoo)": lm,
    "LSTM + GRU, scanned (zoo)": _zoo_classifier("scanned_rnn", zoo.Recurrent()),
    "remat + scan (zoo)": _zoo_classifier("remat_scan", zoo.RematScan()),
}
STRATEGIES = {"ordinary": jdp.strategies.data_parallel, "exact": lambda: jdp.strategies.exact(8)}


class Timed:
    """A wrapped step with its own state and batch, timed over calls."""

    def __init__(self, make, state, batch, strategy, n):
        self.step = jdp.pmap(make(strategy), devices=jax.local_devices()[:n])
        self.state = self.step.replicate(state)
        self.batch = self.step.shard(batch)
        start = time.perf_counter()
        self.run(1)
        self.compile_s = time.perf_counter() - start

    def run(self, steps):
        start = time.perf_counter()
        for _ in range(steps):
            self.state, _ = self.step(self.state, self.batch)
        jax.block_until_ready(self.state)
        return (time.perf_counter() - start) / steps


def bench(model, n, rounds, steps):
    make, state, batch = MODELS[model]()
    timed = {name: Timed(make, state, batch, s(), n) for name, s in STRATEGIES.items()}
    times = {name: [] for name in timed}
    for _ in range(rounds):
        for name, t in timed.items():
            times[name].append(t.run(steps))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "model": model,
        "n": n,
        "ordinary_ms": 1e3 * medians["ordinary"],
        "exact_ms": 1e3 * medians["exact"],
        "exact_over_ordinary": medians["exact"] / medians["ordinary"],
        "compile_s": {name: t.compile_s for name, t in timed.items()},
    }


def _median_ms(fn, *args, calls=50, rounds=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(times)


def recurrent_floor():
    """Milliseconds: the whole batch's gradient, and 8 micro-batches' one after another."""
    _, state, batches = zoo.FAMILIES["scanned_rnn"]()
    batch = jax.tree.map(lambda x: np.concatenate([x] * 4), batches[0])
    grad = jax.grad(zoo.classifier_loss(zoo.Recurrent()))
    micro = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)
    one_after_another = jax.jit(lambda p, m: jax.lax.map(lambda b: grad(p, b), m))
    return _median_ms(jax.jit(grad), state.params, batch), _median_ms(
        one_after_another, state.params, micro
    )


def batched_sums_that_round_differently():
    """``(differ, shapes)``: sums over axis 1 of (8, b, h) against the same over 1, 2, 4 rows."""
    rng = np.random.default_rng(0)
    total = jax.jit(lambda x: x.sum(1))
    differ = shapes = 0
    for b in (3, 7, 16, 32, 64, 128):
        for h in (5, 16, 32, 48, 64, 128):
            x = rng.normal(size=(8, b, h)).astype(np.float32)
            whole = np.asarray(total(x))
            for rows in (1, 2, 4):
                parts = [np.asarray(total(x[i : i + rows])) for i in range(0, 8, rows)]
                shapes += 1
                differ += not np.array_equal(whole, np.concatenate(parts))
    return differ, shapes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # Here, not at import: benchmarks/gpu.py times these models on an accelerator.
    jdp.force_cpu_devices(8)
    print(__doc__.split("\n\n")[0])
    print(
        "| model | n | ordinary ms/step | exact ms/step | exact/ordinary | compile s (ord., exact) |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for model in MODELS:
        for n in (1, 8):
            r = bench(model, n, args.rounds, args.steps)
            rows.append(r)
            c = r["compile_s"]
            print(
                f"| {model} | {n} | {r['ordinary_ms']:.1f} | {r['exact_ms']:.1f} | "
                f"{r['exact_over_ordinary']:.2f} | {c['ordinary']:.1f}, {c['exact']:.1f} |",
                flush=True,
            )
    whole, sequential = recurrent_floor()
    print(
        f"\nLSTM + GRU, one device: the whole batch's gradient {whole:.2f} ms; 8 micro-batches' "
        f"one after another {sequential:.2f} ms ({sequential / whole:.2f}x), before any update"
    )
    differ, shapes = batched_sums_that_round_differently()
    print(
        f"a sum over the batch axis of 8 micro-batches at once rounds differently from 1, 2 "
        f"or 4 at once in {differ} of {shapes} shapes"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return np.asarray([r["exact_over_ordinary"] for r in rows])


if __name__ == "__main__":
    main()

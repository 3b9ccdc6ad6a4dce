"""`make bench`, end to end: what a user runs, not just the step.

For each model (the bench MLP and the demo CNN), backend (pmap, shard_map) and
n = 1, 2, 8 CPU devices, it times three ways of training on the same data:

  fit    jdp.fit(step, state, jdp.BatchIterator(...)) with its prefetch,
         metric read-backs every 10 steps and no progress bar
  loop   the fair reference: a minimal hand-written loop that draws a fresh
         host batch (NumPy fancy indexing of a shuffled permutation), places
         it with one jax.device_put per leaf and calls the same step
  step   the step alone on one batch placed before timing (no input path)

Samples/s are medians over rounds that alternate the three, so machine noise
hits each alike; `fit/loop` is the goal ratio (>= 0.95), `step/loop` shows
what the input path costs at all. With --first-step it also times the first
step of each model (trace + compile + run) in a fresh process, with and
without a warm persistent compilation cache.

Usage: python benchmarks/end_to_end.py [--rounds 5] [--steps 60] [--json out.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax

import jdp

jdp.force_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from jdp import demo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as mlp  # noqa: E402  (the bench MLP of benchmarks/run.py)

DEVICE_COUNTS = (1, 2, 8)


def mlp_setup(size=8192):
    r = np.random.RandomState(0)
    data = {
        "x": r.randn(size, mlp.SIZES[0]).astype(np.float32),
        "y": r.randint(0, mlp.SIZES[-1], size).astype(np.int32),
    }
    return {
        "loss": mlp.loss_fn,
        "has_aux": False,
        "params": mlp.init_params(),
        "data": data,
        "batch": mlp.GLOBAL_BATCH,
    }


def cnn_setup():
    import flax.linen  # noqa: F401  (imported before timing)

    train, _ = demo.load_splits()
    params = demo.CNN().init(jax.random.key(0), train["image"][:1])["params"]
    return {"loss": demo.loss_fn, "has_aux": True, "params": params, "data": train, "batch": 128}


MODELS = {"mlp": mlp_setup, "cnn": cnn_setup}


def make_step(model, backend, n):
    devices = jax.local_devices()[:n]
    step = jdp.make_train_step(model["loss"], has_aux=model["has_aux"])
    if backend == "pmap":
        return jdp.pmap(step, devices=devices)
    return jdp.shard_map(step, mesh=jax.sharding.Mesh(np.asarray(devices), ("batch",)))


def fresh_state(model, step):
    return step.replicate(jdp.TrainState.create(params=model["params"], tx=optax.adam(1e-3)))


def hand_batches(data, batch, reshape, sharding, seed=0):
    """The reference input path: shuffle, index, place; nothing else."""
    size = len(next(iter(data.values())))
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(size)
        for i in range(size // batch):
            idx = order[i * batch : (i + 1) * batch]
            yield {k: jax.device_put(reshape(v[idx]), sharding) for k, v in data.items()}


def placement_of(step, n):
    """(reshape, sharding per key) of a step's batch layout, built once."""
    if isinstance(step, jdp.PmapStep):
        mesh = jax.sharding.Mesh(np.asarray(step.devices), ("batch",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
        return (lambda x: x.reshape((n, -1) + x.shape[1:])), sharding
    sharding = jax.sharding.NamedSharding(step.mesh, jax.sharding.PartitionSpec("batch"))
    return (lambda x: x), sharding


def time_fit(model, step, steps):
    state = fresh_state(model, step)
    it = jdp.BatchIterator(model["data"], model["batch"], seed=0, num_devices=_n(step))
    state, _ = jdp.fit(step, state, it, num_steps=1, progress=False)  # compile, warm
    jax.block_until_ready(state)
    t = time.perf_counter()
    state, _ = jdp.fit(step, state, it, num_steps=1 + steps, progress=False)
    jax.block_until_ready(state)
    return steps / (time.perf_counter() - t)


def time_loop(model, step, steps):
    reshape, sharding = placement_of(step, _n(step))
    state = fresh_state(model, step)
    batches = hand_batches(model["data"], model["batch"], reshape, sharding)
    state, metrics = step(state, next(batches))
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, next(batches))
    jax.block_until_ready((state, metrics))
    return steps / (time.perf_counter() - t)


def time_step(model, step, steps):
    state = fresh_state(model, step)
    batch = step.shard({k: v[: model["batch"]] for k, v in model["data"].items()})
    state, metrics = step(state, batch)
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return steps / (time.perf_counter() - t)


def _n(step):
    return len(step.devices) if isinstance(step, jdp.PmapStep) else step.mesh.size


WAYS = {"fit": time_fit, "loop": time_loop, "step": time_step}


def bench(model_name, backend, n, rounds, steps):
    model = MODELS[model_name]()
    step = make_step(model, backend, n)
    rates = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way, fn in WAYS.items():
            rates[way].append(fn(model, step, steps) * model["batch"])
    med = {way: statistics.median(r) for way, r in rates.items()}
    return {
        "model": model_name,
        "backend": backend,
        "n": n,
        "batch": model["batch"],
        "samples_per_s": med,
        "spread": {way: (min(r), max(r)) for way, r in rates.items()},
        "fit_over_loop": med["fit"] / med["loop"],
        "step_over_loop": med["step"] / med["loop"],
    }


FIRST_STEP = """
import sys, time
t0 = time.perf_counter()
import jax, jdp
jdp.force_cpu_devices(8)
sys.path.insert(0, {bench!r})
import end_to_end as e
model = e.MODELS[{model!r}]()
step = e.make_step(model, "pmap", 8)
state = e.fresh_state(model, step)
batch = step.shard({{k: v[: model["batch"]] for k, v in model["data"].items()}})
t1 = time.perf_counter()
state, metrics = step(state, batch)
jax.block_until_ready(state)
print(time.perf_counter() - t1)
"""


def first_step(model_name):
    """Seconds to the first step's result in a fresh process: no cache, cold cache, warm cache."""
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    code = FIRST_STEP.format(bench=bench_dir, model=model_name)
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for label, env in [
            ("no cache", {}),
            ("cache, first process", {"JAX_COMPILATION_CACHE_DIR": cache}),
            ("cache, second process", {"JAX_COMPILATION_CACHE_DIR": cache}),
        ]:
            env = {
                **os.environ,
                **env,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            }
            result = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            out[label] = float(result.stdout.strip().splitlines()[-1])
    return out


def ledger_cost(calls=100_000):
    """Seconds fit's ledger and phase notes cost per step: what fit calls each step, timed alone."""
    from jdp import _loop
    from jdp._ledger import Ledger

    ledger = Ledger()
    t = time.perf_counter()
    for _ in range(calls):  # per step: data, train (dispatch), train (after it)
        _loop._enter(ledger, "data", 1)
        _loop._enter(ledger, "train", 1)
        ledger.enter("train")
    return (time.perf_counter() - t) / calls


def print_ledger_cost(results):
    """The ledger's cost against the fastest fit step measured above, in the same run."""
    fastest = max(results, key=lambda r: r["samples_per_s"]["fit"] / r["batch"])
    step_s = fastest["batch"] / fastest["samples_per_s"]["fit"]
    cost = statistics.median(ledger_cost() for _ in range(5))
    print(
        f"\nfit's time ledger: {cost * 1e6:.2f} us per step, {100 * cost / step_s:.3f}% of the "
        f"fastest fit step above ({fastest['model']} {fastest['backend']} n={fastest['n']}: "
        f"{step_s * 1e3:.2f} ms)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps per timing")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=["pmap", "shard_map"])
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICE_COUNTS))
    parser.add_argument("--first-step", action="store_true", help="also time compilation")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(
        f"\nend to end: samples/s, median of {args.rounds} alternated rounds x {args.steps} "
        f"steps (min-max in brackets); jax {jax.__version__}"
    )
    print(
        f"{'model':>5} {'backend':>9} {'n':>2} {'fit':>20} {'loop':>20} {'step':>20}"
        f" {'fit/loop':>8} {'step/loop':>9}"
    )
    results = []
    for model in args.models:
        for backend in args.backends:
            for n in args.devices:
                r = bench(model, backend, n, args.rounds, args.steps)
                results.append(r)
                s, sp = r["samples_per_s"], r["spread"]
                cells = " ".join(
                    f"{s[w]:>6.0f} ({sp[w][0]:.0f}-{sp[w][1]:.0f})".rjust(20) for w in WAYS
                )
                print(
                    f"{model:>5} {backend:>9} {n:>2} {cells} {r['fit_over_loop']:>8.3f}"
                    f" {r['step_over_loop']:>9.3f}",
                    flush=True,
                )
    print_ledger_cost(results)
    if args.first_step:
        print("\nfirst step in a fresh process (pmap, 8 devices), seconds")
        for model in args.models:
            f = first_step(model)
            results.append({"model": model, "first_step_s": f})
            print(f"{model:>5} " + "  ".join(f"{k}: {v:.2f}" for k, v in f.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""`make bench`: jdp's steps against a hand-written pmap step, measured in the same run.

For n = 1, 2, 4, 8 CPU devices (subsets of 8 forced devices) it times, on the
same MLP and global batch:

  hand   a minimal hand-written jax.pmap + lax.pmean + optax step (reference)
  jit    (n = 1 only) a plain jax.jit step with no mapped axis, the fastest
         one-device path
  pmap   jdp.pmap(jdp.make_train_step(loss))                 float32
  smap   jdp.shard_map(jdp.make_train_step(loss))            float32
  pmap16 / smap16: the same with precision=jdp.Policy(jnp.bfloat16, cast_batch=("x",))
  pmapZ / smapZ: strategies.zero1() (weight-update sharding, docs/memory.md);
         ratio sharded/replicated
  pmapX / smapX: exact mode, make_train_step(loss, strategy=jdp.strategies.exact(8)): bitwise the
         same result on every device count (docs/exact.md); ratio exact/ordinary

Rounds are interleaved (hand, pmap, smap, ... then again) so machine noise
hits every variant alike; each figure is the median over rounds. Ratios are
steps/s over the hand-written step's steps/s (smap/pmap for the backends).
Compile time is the first call's lower+compile; peak memory is XLA's
per-device estimate for the compiled step (arguments + outputs + temporaries
- aliased donations).

Usage: python benchmarks/run.py [--rounds 7] [--steps 100] [--json out.json]
"""

import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdp

SIZES = (784, 512, 512, 10)
GLOBAL_BATCH = 512


def init_params(seed=0):
    r = np.random.RandomState(seed)
    return {
        f"layer{i}": {
            "w": jnp.asarray(r.randn(a, b) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b, jnp.float32),
        }
        for i, (a, b) in enumerate(itertools.pairwise(SIZES))
    }


def loss_fn(params, batch):
    h = batch["x"]
    for i in range(len(SIZES) - 1):
        layer = params[f"layer{i}"]
        h = h @ layer["w"] + layer["b"]
        if i < len(SIZES) - 2:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def data(seed=1):
    r = np.random.RandomState(seed)
    return {
        "x": r.randn(GLOBAL_BATCH, SIZES[0]).astype(np.float32),
        "y": r.randint(0, SIZES[-1], GLOBAL_BATCH).astype(np.int32),
    }


class HandWritten:
    """The reference: what a researcher writes by hand with pmap."""

    def __init__(self, tx, devices):
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            grads = lax.pmean(grads, "batch")
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.fn = jax.pmap(step, axis_name="batch", devices=devices, donate_argnums=(0, 1))
        self.devices = devices
        self.tx = tx

    def init(self, params):
        return jdp.replicate((params, self.tx.init(params)), self.devices)

    def shard(self, batch):
        return jdp.shard(batch, self.devices)

    def lower(self, state, batch):
        return self.fn.lower(*state, batch)

    def __call__(self, state, batch):
        params, opt_state, loss = self.fn(*state, batch)
        return (params, opt_state), loss


class HandJit:
    """The one-device reference: a plain jax.jit step, no mapped axis at all."""

    def __init__(self, tx, devices):
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.fn = jax.jit(step, donate_argnums=(0, 1))
        self.device = devices[0]
        self.tx = tx

    def init(self, params):
        # Copies: donating an aliased buffer would delete the caller's params.
        state = (params, self.tx.init(params))
        return jax.tree.map(lambda x: jax.device_put(x, self.device, may_alias=False), state)

    def shard(self, batch):
        return jax.device_put(batch, self.device)

    def lower(self, state, batch):
        return self.fn.lower(*state, batch)

    def __call__(self, state, batch):
        params, opt_state, loss = self.fn(*state, batch)
        return (params, opt_state), loss


class Jdp:
    def __init__(self, backend, tx, devices, compute_dtype=None, strategy=None):
        policy = jdp.Policy(compute_dtype, cast_batch=("x",) if compute_dtype else ())
        step = jdp.make_train_step(loss_fn, precision=policy, strategy=strategy)
        if backend == "pmap":
            self.step = jdp.pmap(step, devices=devices)
        else:
            mesh = jax.sharding.Mesh(np.asarray(devices), ("batch",))
            self.step = jdp.shard_map(step, mesh=mesh)
        self.tx = tx

    def init(self, params):
        return self.step.replicate(jdp.TrainState.create(params=params, tx=self.tx))

    def shard(self, batch):
        return self.step.shard(batch)

    def lower(self, state, batch):
        return self.step.lower(state, batch)

    def __call__(self, state, batch):
        return self.step(state, batch)


def peak_mib(lowered):
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return total / 2**20


def warmed(runners, step_of=lambda runner: runner):
    """``(states, batches)``: each runner's bench state and batch, placed by ``step_of(runner)``, after one call."""
    states, batches = {}, {}
    for name, runner in runners.items():
        step = step_of(runner)
        state = jdp.TrainState.create(params=init_params(), tx=optax.adam(1e-3))
        states[name], batches[name] = step.replicate(state), step.shard(data())
        states[name], m = runner(states[name], batches[name])
        jax.block_until_ready(m)
    return states, batches


def time_rounds(variants, states, batches, rounds, steps):
    """``{name: [seconds per step, one per round]}``, rounds interleaved over the variants.

    ``states`` is updated in place with each variant's last state.
    """
    seconds = {name: [] for name in variants}
    for _ in range(rounds):
        for name, v in variants.items():
            state, batch = states[name], batches[name]
            t = time.perf_counter()
            for _ in range(steps):
                state, out = v(state, batch)
            jax.block_until_ready((state, out))
            seconds[name].append((time.perf_counter() - t) / steps)
            states[name] = state
    return seconds


def bench_n(n, rounds, steps):
    devices = jax.local_devices()[:n]
    tx = optax.adam(1e-3)
    variants = {
        **({"jit": HandJit(tx, devices)} if n == 1 else {}),
        "hand": HandWritten(tx, devices),
        "pmap": Jdp("pmap", tx, devices),
        "smap": Jdp("shard_map", tx, devices),
        "pmap16": Jdp("pmap", tx, devices, jnp.bfloat16),
        "smap16": Jdp("shard_map", tx, devices, jnp.bfloat16),
        "pmapX": Jdp("pmap", tx, devices, strategy=jdp.strategies.exact(8)),
        "smapX": Jdp("shard_map", tx, devices, strategy=jdp.strategies.exact(8)),
        "pmapZ": Jdp("pmap", tx, devices, strategy=jdp.strategies.zero1()),
        "smapZ": Jdp("shard_map", tx, devices, strategy=jdp.strategies.zero1()),
    }
    params, host_batch = init_params(), data()
    states, batches, compile_s, memory = {}, {}, {}, {}
    for name, v in variants.items():
        states[name] = v.init(params)
        batches[name] = v.shard(host_batch)
        t = time.perf_counter()
        lowered = v.lower(states[name], batches[name])
        memory[name] = peak_mib(lowered)
        compile_s[name] = time.perf_counter() - t
        states[name], out = v(states[name], batches[name])  # warm the dispatch cache
        jax.block_until_ready(out)
    seconds = time_rounds(variants, states, batches, rounds, steps)
    rates = {name: [1 / t for t in ts] for name, ts in seconds.items()}
    medians = {name: statistics.median(r) for name, r in rates.items()}
    return {
        "n": n,
        "steps_per_s": medians,
        "spread": {name: (min(r), max(r)) for name, r in rates.items()},
        "ratio_vs_hand": {name: medians[name] / medians["hand"] for name in variants},
        "smap_over_pmap": medians["smap"] / medians["pmap"],
        "exact_over_ordinary": {
            "pmap": medians["pmapX"] / medians["pmap"],
            "smap": medians["smapX"] / medians["smap"],
        },
        "sharded_over_replicated": {
            "pmap": medians["pmapZ"] / medians["pmap"],
            "smap": medians["smapZ"] / medians["smap"],
        },
        "compile_s": compile_s,
        "peak_mib_per_device": memory,
    }


def print_variant_table(results, suffix: str, ratios: str, title: str) -> None:
    """Steps/s, ratio to the ordinary step and peak of the pmap/smap + ``suffix`` variants."""
    p, q = f"pmap{suffix}", f"smap{suffix}"
    print(f"\n{title}")
    print(
        f"{'n':>2} {p + '/s':>8} {q + '/s':>8} {p + '/pmap':>10} {q + '/smap':>10}"
        f" {f'peak MiB ({p},{q})':>24}"
    )
    for r in results:
        s, z, m = r["steps_per_s"], r[ratios], r["peak_mib_per_device"]
        print(
            f"{r['n']:>2} {s[p]:>8.1f} {s[q]:>8.1f} {z['pmap']:>10.3f} {z['smap']:>10.3f}"
            f"       {m[p]:>7.1f},{m[q]:>7.1f}"
        )


def main():
    # Here, not at import: torch_ddp.py and end_to_end.py import this module's
    # MLP into processes with their own device counts.
    jdp.force_cpu_devices(8)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    print(
        f"MLP {SIZES}, global batch {GLOBAL_BATCH}, Adam; median of {args.rounds} "
        f"rounds x {args.steps} steps; jax {jax.__version__}"
    )
    header = (
        f"{'n':>2} {'hand/s':>8} {'pmap/s':>8} {'smap/s':>8} {'pmap16/s':>9} {'smap16/s':>9}"
        f" {'pmap/hand':>9} {'smap/hand':>9} {'smap/pmap':>9} {'compile s (hand,pmap,smap)':>27}"
        f" {'peak MiB (hand,pmap,smap,pmap16)':>33}"
    )
    print(header)
    results = []
    for n in args.devices:
        r = bench_n(n, args.rounds, args.steps)
        results.append(r)
        s, q, c, m = r["steps_per_s"], r["ratio_vs_hand"], r["compile_s"], r["peak_mib_per_device"]
        print(
            f"{n:>2} {s['hand']:>8.1f} {s['pmap']:>8.1f} {s['smap']:>8.1f} {s['pmap16']:>9.1f}"
            f" {s['smap16']:>9.1f} {q['pmap']:>9.3f} {q['smap']:>9.3f} {r['smap_over_pmap']:>9.3f}"
            f" {c['hand']:>9.2f},{c['pmap']:>5.2f},{c['smap']:>5.2f}"
            f"       {m['hand']:>6.1f},{m['pmap']:>6.1f},{m['smap']:>6.1f},{m['pmap16']:>6.1f}",
            flush=True,
        )
    for r in results:
        if "jit" in r["steps_per_s"]:
            s = r["steps_per_s"]
            print(
                f"\nn = 1 against a plain jax.jit step ({s['jit']:.1f} steps/s): "
                f"pmap {s['pmap'] / s['jit']:.3f}, shard_map {s['smap'] / s['jit']:.3f}, "
                f"hand-written pmap {s['hand'] / s['jit']:.3f}"
            )
    print_variant_table(
        results,
        "X",
        "exact_over_ordinary",
        "exact mode (strategies.exact(8)) against the ordinary step of the same backend",
    )
    print_variant_table(
        results,
        "Z",
        "sharded_over_replicated",
        "weight-update sharding (strategies.zero1()) against the replicated step",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

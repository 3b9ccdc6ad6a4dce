"""Sharded strategies on a 12-layer transformer LM: memory, collective bytes, step time.

A plain-JAX decoder LM (12 blocks, d = 256, vocab 512, 32 tokens; about 9.7M
float32 parameters) with Adam, global batch 16, under jdp.shard_map on
n = 2, 4, 8 CPU devices: data_parallel, zero1, fsdp, exact(8) and
exact(8, shard_optimizer_state=True) ("exact_split"). fsdp gathers block by
block (``fsdp(layers=...)`` with ``jdp.strategies.layer`` around each block).
Per device, for each strategy:

  state MiB      the placed training state (device 0's shards)
  ideal MiB      (params + grads + Adam's moments) / n: the floor a fully
                 sharded state can reach (16P / n bytes)
  peak MiB       XLA's compiled estimate: arguments + outputs + temporaries -
                 donated aliases
  sent / ring    bytes each device sends per step in the compiled HLO's
                 collectives (ring algorithms: an all-reduce of B bytes sends
                 2(n-1)/n B, an all-gather producing B sends (n-1)/n B, a
                 reduce-scatter of B sends (n-1)/n B, an all-to-all of B
                 sends (n-1)/n B), over the ring
                 all-reduce bound 2(n-1)/n x the gradient bytes
  step ms        median over repeats of the mean of timed steps

Usage: python benchmarks/sharded.py [--json out.json] [--repeats 3]
"""

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax

import jdp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20
# One instruction per line; a tuple result's type may hold /*index=5*/ comments.
_OP = re.compile(
    r"^\s*\S+ = (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", re.M
)
_SHAPE = re.compile(r"(f32|bf16|f16|s32|u32|pred)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}


def result_bytes(types: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(types):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES[dtype]
    return total


def sent_bytes(hlo: str, n: int) -> float:
    """Bytes one device sends per step under ring algorithms, from the compiled HLO."""
    sent = 0.0
    for types, op in _OP.findall(hlo):
        b = result_bytes(types)
        if op == "all-reduce":
            sent += 2 * (n - 1) / n * b
        elif op in ("all-gather", "all-to-all"):  # all-to-all keeps 1/n of its bytes
            sent += (n - 1) / n * b
        else:  # reduce-scatter: the result is 1/n of the input
            sent += (n - 1) * b
    return sent


def strategies():
    from tests import models

    return {
        "data_parallel": jdp.strategies.data_parallel(),
        "zero1": jdp.strategies.zero1(),
        "fsdp": jdp.strategies.fsdp(layers=models.in_blocks),
        "exact": jdp.strategies.exact(8),
        "exact_split": jdp.strategies.exact(8, shard_optimizer_state=True),
    }


def step_seconds(step, state, batch, repeats: int, calls: int = 3) -> tuple[object, list[float]]:
    """The last state, and seconds per call, one figure per repeat: a warm-up call, then ``calls`` timed ones."""
    times = []
    for _ in range(repeats):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        for _ in range(calls):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append((time.perf_counter() - start) / calls)
    return state, times


def measure(n: int, name: str, strategy, repeats: int, model: int = 1, scan: bool = False) -> dict:
    """One row; with ``model`` > 1 on an (n, model) mesh, every matrix (and its Adam moments) split by columns over it;
    with ``scan``, the blocks stacked and applied in a ``jax.lax.scan``."""
    import numpy as np
    import optax

    from tests import models
    from tests.test_model_axes import mesh_of, split_state

    params = models.lm_params(layers=12, d=256, vocab=512, seq=32)
    params = models.stacked(params) if scan else params
    loss = models.lm_scan_loss if scan else models.lm_loss
    batch = models.lm_batch(16, vocab=512, seq=32)
    mesh = (
        mesh_of(n, model)
        if model > 1
        else jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",))
    )
    step = jdp.shard_map(jdp.make_train_step(loss, strategy=strategy), mesh=mesh)
    state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
    if model > 1:
        state = split_state(state, mesh)
    sharded = step.shard(batch)
    start = time.perf_counter()
    compiled = step.lower(state, sharded).compile()
    compile_s = time.perf_counter() - start
    m = compiled.memory_analysis()
    count = sum(x.size for x in jax.tree.leaves(params))
    state, times = step_seconds(step, state, sharded, repeats)
    ring = 2 * (n - 1) / n * 4 * count
    return {
        "n": n,
        "model": model,
        "strategy": name,
        "parameters": count,
        "state_mib": sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state)) / MiB,
        "ideal_mib": 16 * count / n / MiB,
        "peak_mib": (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )
        / MiB,
        "sent_over_ring": sent_bytes(compiled.as_text(), n) / ring,
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    jdp.force_cpu_devices(8)
    rows = [
        measure(n, name, s, args.repeats) for n in (2, 4, 8) for name, s in strategies().items()
    ]
    print(
        f"\nsharded strategies, 12-layer LM ({rows[0]['parameters'] / 1e6:.1f}M float32 "
        f"parameters), Adam, shard_map; jax {jax.__version__}"
    )
    print(
        f"{'n':>2} {'strategy':>13} {'state MiB':>9} {'ideal MiB':>9} {'state/ideal':>11}"
        f" {'peak MiB':>8} {'peak/dp':>7} {'sent/ring':>9} {'compile s':>9} {'step ms':>8}"
        f" {'step/dp':>7}"
    )
    for r in rows:
        dp = next(x for x in rows if x["n"] == r["n"] and x["strategy"] == "data_parallel")
        print(
            f"{r['n']:>2} {r['strategy']:>13} {r['state_mib']:>9.1f} {r['ideal_mib']:>9.1f}"
            f" {r['state_mib'] / r['ideal_mib']:>11.3f} {r['peak_mib']:>8.1f}"
            f" {r['peak_mib'] / dp['peak_mib']:>7.3f} {r['sent_over_ring']:>9.3f}"
            f" {r['compile_s']:>9.2f} {r['step_ms']:>8.1f} {r['step_ms'] / dp['step_ms']:>7.3f}"
        )
    rows += scanned(args.repeats)
    rows += model_axes(args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def scanned(repeats: int) -> list[dict]:
    """The LM with its blocks in a scan, n = 8: fsdp() gathers the stack whole, fsdp(stacked=...) a layer."""
    from tests import models

    chosen = {
        "data_parallel": jdp.strategies.data_parallel(),
        "fsdp": jdp.strategies.fsdp(),
        "fsdp_stacked": jdp.strategies.fsdp(stacked=models.in_blocks),
    }
    rows = [measure(8, name, s, repeats, scan=True) for name, s in chosen.items()]
    print("\nblocks in a jax.lax.scan, n = 8")
    print(
        f"{'strategy':>13} {'state MiB':>9} {'peak MiB':>8} {'peak/dp':>7} {'step ms':>8} {'step/dp':>7}"
    )
    for r in rows:
        print(
            f"{r['strategy']:>13} {r['state_mib']:>9.1f} {r['peak_mib']:>8.1f}"
            f" {r['peak_mib'] / rows[0]['peak_mib']:>7.3f} {r['step_ms']:>8.1f}"
            f" {r['step_ms'] / rows[0]['step_ms']:>7.3f}"
        )
    return [dict(r, scan=True) for r in rows]


def model_axes(repeats: int) -> list[dict]:
    """data_parallel on (2, m) meshes, matrices split over m, against the 1-D mesh of 2 replicas."""
    rows = [measure(2, "data_parallel", jdp.strategies.data_parallel(), repeats, m) for m in (2, 4)]
    flat = measure(2, "data_parallel", jdp.strategies.data_parallel(), repeats)
    print("\nmodel axes: data_parallel, 2 replicas, every matrix split by columns over 'model'")
    print(
        f"{'mesh':>6} {'state MiB':>9} {'state/1-D':>9} {'peak MiB':>8} {'peak/1-D':>8} {'step ms':>8} {'step/1-D':>8}"
    )
    for r in [flat, *rows]:
        print(
            f"{'2' if r['model'] == 1 else '2x' + str(r['model']):>6} {r['state_mib']:>9.1f}"
            f" {r['state_mib'] / flat['state_mib']:>9.3f} {r['peak_mib']:>8.1f}"
            f" {r['peak_mib'] / flat['peak_mib']:>8.3f} {r['step_ms']:>8.1f}"
            f" {r['step_ms'] / flat['step_ms']:>8.3f}"
        )
    return rows


if __name__ == "__main__":
    main()

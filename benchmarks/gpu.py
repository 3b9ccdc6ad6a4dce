"""jdp on one accelerator: the exact-mode zoo's bits, the step's cost, exact mode's cost, memory.

`make bench` measures on forced CPU devices. This script is for a machine with
one GPU (or TPU chip), where the device count is 1, so it measures what one
device can show:

  zoo     every family of tests/zoo.py, 3 exact-mode steps on the accelerator
          under jdp.shard_map and jdp.pmap, each run twice: whether a run
          repeats its own bits, whether the two backends agree bit for bit, and
          the largest difference from the same steps on 8 CPU devices of the
          same machine (which must agree with 1 CPU device bit for bit; exact
          mode promises bits within one kind of hardware, not across kinds)
  step    benchmarks/run.py's MLP at n = 1: jdp's steps against a hand-written
          jax.jit one, compile time and XLA's peak estimate
  exact   benchmarks/exact_cost.py's models at n = 1: exact/ordinary step time
  memory  benchmarks/sharded.py's 12-layer LM at n = 1 and a GPT-2-small-shaped
          one (d = 768, 256 tokens): XLA's peak estimate, the allocator's peak,
          step time

The docs' figures come from two runs: this script as is, and
``XLA_FLAGS=--xla_gpu_deterministic_ops=true python benchmarks/gpu.py --zoo-only``.
Without an accelerator it runs on CPU device 0 as a dry run of itself.

Usage: python benchmarks/gpu.py [--zoo-only] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

# 8 CPU devices beside the accelerator, for the zoo's CPU reference; before any backend starts.
os.environ.setdefault("PJRT_NPROC", "16")
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import exact_cost, run, sharded  # noqa: E402
from tests import models, zoo  # noqa: E402

MiB = 2**20


def host(tree):
    """Host arrays, PRNG keys as their key data, so leaves compare with numpy."""
    return [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for x in jax.tree.leaves(tree)
    ]


def bitwise(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(host(a), host(b), strict=True))


def largest_difference(a, b) -> float:
    diffs = [
        float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
        for x, y in zip(host(a), host(b), strict=True)
        if np.issubdtype(x.dtype, np.floating)
    ]
    return max(diffs, default=0.0)


def zoo_row(family: str, accelerator, cpus) -> dict:
    make, state, batches = zoo.FAMILIES[family]()
    check = jdp.testing.check_exact
    runs = {
        name: [
            check(make, state, batches, device_counts=(1,), backend=backend, devices=[accelerator])[
                1
            ]
            for _ in range(2)
        ]
        for name, backend in (("shard_map", jdp.shard_map), ("pmap", jdp.pmap))
    }
    row = {
        "family": family,
        "repeats": {name: bitwise(*pair) for name, pair in runs.items()},
        "backends_agree": bitwise(runs["shard_map"][0], runs["pmap"][0]),
    }
    if cpus:  # check_exact raises unless 1 and 8 CPU devices agree bit for bit
        on_cpu = check(make, state, batches, device_counts=(1, 8), devices=cpus)[1]
        row["vs_cpu"] = largest_difference(runs["shard_map"][0], on_cpu)
    return row


def zoo_section(accelerator, cpus) -> list[dict]:
    print(
        "\n| family | repeats (shard_map, pmap) | pmap == shard_map | max abs diff vs 8 CPU devices |"
    )
    print("|---|---|---|---|")
    rows = []
    for family in zoo.FAMILIES:
        r = zoo_row(family, accelerator, cpus)
        rows.append(r)
        print(
            f"| {family} | {r['repeats']['shard_map']}, {r['repeats']['pmap']} | "
            f"{r['backends_agree']} | {r.get('vs_cpu', float('nan')):.2e} |",
            flush=True,
        )
    return rows


def step_section() -> dict:
    r = run.bench_n(1, rounds=7, steps=200)
    print("\n| variant | steps/s | / hand jit | compile s | peak MiB |")
    print("|---|---|---|---|---|")
    for name, rate in r["steps_per_s"].items():
        print(
            f"| {name} | {rate:.0f} | {rate / r['steps_per_s']['jit']:.3f} | "
            f"{r['compile_s'][name]:.2f} | {r['peak_mib_per_device'][name]:.1f} |",
            flush=True,
        )
    return r


def exact_section() -> list[dict]:
    print("\n| model | ordinary ms | exact ms | exact/ordinary | compile s (ord., exact) |")
    print("|---|---|---|---|---|")
    rows = []
    for model in exact_cost.MODELS:
        r = exact_cost.bench(model, 1, rounds=5, steps=20)
        rows.append(r)
        c = r["compile_s"]
        print(
            f"| {model} | {r['ordinary_ms']:.2f} | {r['exact_ms']:.2f} | "
            f"{r['exact_over_ordinary']:.2f} | {c['ordinary']:.1f}, {c['exact']:.1f} |",
            flush=True,
        )
    return rows


def lm_row(accelerator, d: int, seq: int, batch: int) -> dict:
    params = models.lm_params(layers=12, d=d, vocab=512, seq=seq)
    step = jdp.shard_map(jdp.make_train_step(models.lm_loss), devices=[accelerator])
    state = step.replicate(jdp.TrainState.create(params=params, tx=optax.adam(1e-3)))
    data = step.shard(models.lm_batch(batch, vocab=512, seq=seq))
    start = time.perf_counter()
    peak = run.peak_mib(step.lower(state, data))
    compile_s = time.perf_counter() - start
    _, times = sharded.step_seconds(step, state, data, repeats=5, calls=5)
    stats = accelerator.memory_stats() or {}
    return {
        "d": d,
        "seq": seq,
        "batch": batch,
        "parameters": sum(x.size for x in jax.tree.leaves(params)),
        "xla_peak_mib": peak,
        "allocator_peak_mib": stats.get("peak_bytes_in_use", float("nan")) / MiB,
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
        "tokens_per_s": batch * seq / statistics.median(times),
    }


def memory_section(accelerator) -> list[dict]:
    print(
        "\n| 12-layer LM | parameters | XLA peak MiB | allocator peak MiB | compile s | step ms | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    sizes = [(256, 32, 16), (768, 256, 32)]
    for d, seq, batch in sizes[: 1 if accelerator.platform == "cpu" else 2]:  # CPU: a dry run
        r = lm_row(accelerator, d, seq, batch)
        rows.append(r)
        print(
            f"| d={d}, {batch}x{seq} tokens | {r['parameters'] / 1e6:.1f}M | {r['xla_peak_mib']:.0f} | "
            f"{r['allocator_peak_mib']:.0f} | {r['compile_s']:.1f} | {r['step_ms']:.2f} | "
            f"{r['tokens_per_s']:.0f} |",
            flush=True,
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--zoo-only",
        action="store_true",
        help="only the zoo on the accelerator (a second run's flags)",
    )
    parser.add_argument("--json", help="also write the results here, after each section")
    args = parser.parse_args()
    accelerator, cpus = jax.devices()[0], jax.devices("cpu")
    kind = getattr(accelerator, "device_kind", accelerator.platform)
    print(
        f"jdp {jdp.__version__}, jax {jax.__version__}, {kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    if accelerator.platform == "cpu":
        print("no accelerator: a dry run on CPU device 0")
    sections = {"zoo": lambda: zoo_section(accelerator, [] if args.zoo_only else cpus)}
    if not args.zoo_only:  # the quick ones first
        sections = {
            "step": step_section,
            "exact": exact_section,
            "memory": lambda: memory_section(accelerator),
            **sections,
        }
    results = {"device": kind, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for name, section in sections.items():
        results[name] = section()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()

"""Where a jdp step's time goes: a jax.profiler trace, summarized as text.

Traces ``--steps`` steps of the bench MLP (benchmarks/run.py: 784-512-512-10,
Adam, global batch 512) under jdp.shard_map on n CPU devices, then reads the
trace back (``jax.profiler.ProfileData``) and sums XLA:CPU's op events by
kind (matmuls, fused elementwise work, collectives including the wait for the
other devices, the rest) and the host's Python calls (jdp's wrapper, JAX's
dispatch), per step. Nothing binary is kept: the trace
is written to a temporary folder and deleted.

Usage: python benchmarks/profile_step.py [--devices 2] [--steps 50]
"""

import argparse
import collections
import os
import pathlib
import sys
import tempfile
import time

import jax

import jdp

KINDS = (
    (
        "collectives",
        ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective", "rendezvous"),
    ),
    ("matmuls", ("ynn_fusion", "xnn", "dot", "gemm", "matmul", "convolution")),
    ("fused elementwise", ("fusion",)),
)
# Executor bookkeeping and waiting: they enclose or wait for the ops above.
CONTAINERS = (
    "ThunkExecutor",
    "CommonPjRt",
    "[",
    "ExecutePrepare",
    "Handle",
    "AllocateOutput",
    "ThreadpoolListener",
    "end:",
    "Wait:",
    "SlinkyThreadPool",
)


def _classify(line: str, event: str) -> str | None:
    """The kind of one trace event, or None for markers and enclosing events."""
    if line == "python":
        if event.startswith("$parallel.py") and event.endswith("__call__"):
            return "python: jdp wrapper call"
        if event.startswith("PjitFunction"):
            return "python: jax dispatch"
        return None
    if not line.startswith("tf_XLA") or event.startswith(CONTAINERS):
        return None
    low = event.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other ops")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    jdp.force_cpu_devices(args.devices)
    import numpy as np
    import optax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run as mlp

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("batch",))
    step = jdp.shard_map(jdp.make_train_step(mlp.loss_fn), mesh=mesh)
    state = step.replicate(jdp.TrainState.create(params=mlp.init_params(), tx=optax.adam(1e-3)))
    batch = step.shard(mlp.data())
    for _ in range(10):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        with jax.profiler.trace(folder):
            for _ in range(args.steps):
                state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
        wall = time.perf_counter() - start
        (path,) = pathlib.Path(folder).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
        totals, counts = collections.Counter(), collections.Counter()
        names = collections.defaultdict(collections.Counter)
        # XLA:CPU records its work on the host plane: the executor threads'
        # thunks (fusions, dots, collectives) and Python's dispatch calls.
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    kind = _classify(line.name, event.name)
                    if kind is None:
                        continue
                    totals[kind] += event.duration_ns
                    counts[kind] += 1
                    names[kind][event.name] += event.duration_ns
    busy = sum(v for k, v in totals.items() if not k.startswith("python"))
    print(
        f"\nprofile: MLP {mlp.SIZES}, batch {mlp.GLOBAL_BATCH}, Adam, shard_map on "
        f"{args.devices} CPU devices, {args.steps} steps in {wall:.2f} s "
        f"({1e3 * wall / args.steps:.1f} ms per step); device events summed over devices"
    )
    print(
        "(XLA:CPU's ops, summed over its worker threads, share of their sum; python rows: "
        "the host's calls, which include waiting for the previous step)"
    )
    print(f"{'kind':>26} {'ms/step':>8} {'share':>6} {'events/step':>11}  largest")
    for kind, ns in totals.most_common():
        top = ", ".join(n for n, _ in names[kind].most_common(3))
        print(
            f"{kind:>26} {ns / 1e6 / args.steps:>8.2f}"
            f" {'' if kind.startswith('python') else f'{ns / busy:.1%}':>6}"
            f" {counts[kind] / args.steps:>11.1f}  {top[:70]}"
        )


if __name__ == "__main__":
    main()

"""jdp against PyTorch DistributedDataParallel on the same MLP, batch and optimizer.

The bench MLP of benchmarks/run.py (784-512-512-10, ReLU, softmax
cross-entropy), Adam (lr 1e-3), global batch 512, float32, on this machine's
CPU cores, with 1 and 2 replicas:

  jdp    one process: jdp.shard_map(jdp.make_train_step(loss)) over n forced
         CPU devices (how JAX runs data parallel on one host)
  torch  n processes (gloo): DistributedDataParallel(model), each rank with
         global_batch / n examples and cores / n intra-op threads (what
         torchrun's OMP_NUM_THREADS=1 default amounts to on small hosts); at
         n = 1 plain PyTorch, no DDP wrapper

Each measurement is a fresh set of processes that warms up, then times
``--steps`` steps on a batch placed before timing (the step: forward,
backward, gradient all-reduce, Adam). Rounds alternate the four
configurations; the table gives medians and min-max over rounds. torch is an
optional benchmark dependency (``pip install torch==2.13.0``), never a test
or core one.

Usage: python benchmarks/torch_ddp.py [--rounds 5] [--steps 200] [--json out.json]
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

GLOBAL_BATCH = 512
SIZES = (784, 512, 512, 10)
WARMUP = 20


def run_jdp(n: int, steps: int) -> float:
    import jax

    import jdp

    jdp.force_cpu_devices(n)
    import numpy as np
    import optax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run as mlp

    step = jdp.shard_map(
        jdp.make_train_step(mlp.loss_fn),
        mesh=jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",)),
    )
    state = step.replicate(jdp.TrainState.create(params=mlp.init_params(), tx=optax.adam(1e-3)))
    batch = step.shard(mlp.data())
    for _ in range(WARMUP):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return steps * GLOBAL_BATCH / (time.perf_counter() - t)


def _torch_rank(rank: int, n: int, steps: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(max(os.cpu_count() // n, 1))
    if n > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers.append(nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    if n > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(GLOBAL_BATCH // n, SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (GLOBAL_BATCH // n,), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(WARMUP):
        step()
    if n > 1:
        dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if n > 1:
        dist.barrier()
    rate = steps * GLOBAL_BATCH / (time.perf_counter() - t)
    if rank == 0:
        out.put(rate)
    if n > 1:
        dist.destroy_process_group()


def run_torch(n: int, steps: int) -> float:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_torch_rank, args=(r, n, steps, port, out)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"torch rank exited with {p.exitcode}")
    return out.get()


def measure(framework: str, n: int, steps: int) -> float:
    """samples/s of one configuration, in fresh processes."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
        f"import torch_ddp as t; print(t.run_{framework}({n}, {steps}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode:
        raise RuntimeError(f"{framework} n={n} failed:\n{result.stderr[-2000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("\ntorch_ddp: torch is not installed (pip install torch==2.13.0); skipped.")
        return
    import jax

    configs = [("jdp", 1), ("torch", 1), ("jdp", 2), ("torch", 2)]
    rates = {c: [] for c in configs}
    for _ in range(args.rounds):
        for framework, n in configs:
            rates[(framework, n)].append(measure(framework, n, args.steps))
    med = {c: statistics.median(r) for c, r in rates.items()}
    print(
        f"\njdp vs PyTorch on the bench MLP, global batch {GLOBAL_BATCH}, Adam; samples/s, "
        f"median (min-max) of {args.rounds} alternated rounds x {args.steps} steps; "
        f"jax {jax.__version__}, torch {torch.__version__}, {os.cpu_count()} cores"
    )
    print(f"{'replicas':>8} {'jdp':>22} {'torch':>22} {'jdp/torch':>9}")
    results = []
    for n in (1, 2):
        j, t = rates[("jdp", n)], rates[("torch", n)]
        ratio = med[("jdp", n)] / med[("torch", n)]
        cell = lambda r: f"{statistics.median(r):>7.0f} ({min(r):.0f}-{max(r):.0f})"  # noqa: E731
        print(f"{n:>8} {cell(j):>22} {cell(t):>22} {ratio:>9.2f}")
        results.append({"replicas": n, "jdp": j, "torch": t, "jdp_over_torch": ratio})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

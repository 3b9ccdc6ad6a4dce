"""`make bench`: what jdp.Audit costs, and how often it alarms on clean steps.

Cost: the bench MLP of benchmarks/run.py (784-512-512-10, Adam, global batch
512) on 8 CPU devices, for each backend:

  plain      jdp.make_train_step(loss)                                 (reference)
  audit@1    make_train_step(loss, audit=jdp.Audit(every=1))
  audit@100  make_train_step(loss, audit=jdp.Audit(every=100))

and exact mode's recomputation check, against exact mode without it:

  exact          make_train_step(loss, strategy=exact(8))              (reference)
  recompute@1    strategy=exact(8, recompute_every=1)
  recompute@8    strategy=exact(8, recompute_every=8)
  recompute@100  strategy=exact(8, recompute_every=100)

Rounds are interleaved so machine noise hits every variant alike; each
figure is the median over rounds of the mean step time of ``--steps`` calls;
the ratio is audited/plain step time (goal at every=1: <= 1.005), and
checked/exact step time.

False alarms: ``--clean`` clean steps of a tiny MLP at 8 devices with
audit every step, for data_parallel and exact mode (with recompute_every=1)
on both backends; the count of steps whose audit or recomputation did not
report agreement (goal: 0).

Usage: python benchmarks/audit.py [--rounds 7] [--steps 50] [--clean 10000] [--json out.json]
"""

import argparse
import json
import statistics
import sys

import jdp

jdp.force_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from benchmarks import run as bench  # noqa: E402
from tests import models  # noqa: E402

BACKENDS = {"pmap": jdp.pmap, "shard_map": jdp.shard_map}


def variant(backend, every):
    audit = None if every is None else jdp.Audit(every=every)
    return BACKENDS[backend](jdp.make_train_step(bench.loss_fn, audit=audit))


def exact_variant(backend, every):
    strategy = jdp.strategies.exact(8, recompute_every=every)
    return BACKENDS[backend](jdp.make_train_step(bench.loss_fn, strategy=strategy))


VARIANTS = {
    "audit": (variant, {"plain": None, "audit@1": 1, "audit@100": 100}),
    "recompute": (
        exact_variant,
        {"exact": None, "recompute@1": 1, "recompute@8": 8, "recompute@100": 100},
    ),
}


def cost(rounds, steps):
    out = {}
    for backend in BACKENDS:
        for check, (make, variants) in VARIANTS.items():
            runners = {name: make(backend, every) for name, every in variants.items()}
            states, batches = bench.warmed(runners)
            times = bench.time_rounds(runners, states, batches, rounds, steps)
            for step in runners.values():
                step.check_audit()
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            reference = next(iter(variants))
            out[f"{backend}/{check}"] = {
                "ms": ms,
                "ratio": {name: ms[name] / ms[reference] for name in variants if name != reference},
            }
    return out


def false_alarms(clean):
    out = {}
    data = [models.regression_batch(32, seed=50 + i) for i in range(16)]
    for backend in BACKENDS:
        exact = jdp.strategies.exact(8, recompute_every=1)
        for mode, strategy in (("data_parallel", None), ("exact", exact)):
            step = BACKENDS[backend](
                jdp.make_train_step(models.mlp_loss, strategy=strategy, audit=jdp.Audit())
            )
            state = step.replicate(
                jdp.TrainState.create(params=models.mlp_params(), tx=optax.adam(1e-3))
            )
            batches = [step.shard(b) for b in data]
            results = []
            for i in range(clean):
                state, m = step(state, batches[i % len(batches)])
                results.append([m[k] for k in ("audit", "recompute") if k in m])
            step.check_audit()
            alarms = [any(np.asarray(r)[0][1] != -1 for r in rs) for rs in results]
            out[f"{backend}/{mode}"] = int(np.sum(alarms))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--clean", type=int, default=10000)
    parser.add_argument("--json")
    args = parser.parse_args()
    costs = cost(args.rounds, args.steps)
    print(
        "jdp.Audit and exact mode's recompute_every on the bench MLP, 8 CPU devices, "
        f"median of {args.rounds} rounds:"
    )
    for backend, row in costs.items():
        ms = "  ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items())
        ratio = "  ".join(f"{k} {v:.3f}x" for k, v in row["ratio"].items())
        print(f"  {backend:19s} {ms}   ratio {ratio}")
    alarms = false_alarms(args.clean)
    print(
        f"false alarms in {args.clean} clean steps (tiny MLP, 8 devices, audit and "
        "exact mode's recomputation every step):"
    )
    for name, count in alarms.items():
        print(f"  {name:24s} {count}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cost": costs, "false_alarms": alarms, "clean_steps": args.clean}, f)


if __name__ == "__main__":
    main()

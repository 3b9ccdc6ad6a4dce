"""`make bench`: what jdp.Audit costs, and how often it alarms on clean steps.

Cost: the bench MLP of benchmarks/run.py (784-512-512-10, Adam, global batch
512) on 8 CPU devices, for each backend:

  plain      jdp.make_train_step(loss)                                 (reference)
  audit@1    make_train_step(loss, audit=jdp.Audit(every=1))
  audit@100  make_train_step(loss, audit=jdp.Audit(every=100))

Rounds are interleaved so machine noise hits every variant alike; each
figure is the median over rounds of the mean step time of ``--steps`` calls;
the ratio is audited/plain step time (goal at every=1: <= 1.005).

False alarms: ``--clean`` clean steps of a tiny MLP at 8 devices with
audit every step, for data_parallel and exact mode on both backends; the
count of steps whose audit did not report agreement (goal: 0).

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


def cost(rounds, steps):
    out = {}
    for backend in BACKENDS:
        variants = {"plain": None, "audit@1": 1, "audit@100": 100}
        runners = {name: variant(backend, every) for name, every in variants.items()}
        states, batches = bench.warmed(runners)
        times = bench.time_rounds(runners, states, batches, rounds, steps)
        for step in runners.values():
            step.check_audit()
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        out[backend] = {
            "ms": ms,
            "ratio": {name: ms[name] / ms["plain"] for name in variants if name != "plain"},
        }
    return out


def false_alarms(clean):
    out = {}
    data = [models.regression_batch(32, seed=50 + i) for i in range(16)]
    for backend in BACKENDS:
        for mode, strategy in (("data_parallel", None), ("exact", jdp.strategies.exact(8))):
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
                results.append(m["audit"])
            step.check_audit()
            replicas = np.asarray([np.asarray(r)[0][1] for r in results])
            out[f"{backend}/{mode}"] = int(np.sum(replicas != -1))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--clean", type=int, default=10000)
    parser.add_argument("--json")
    args = parser.parse_args()
    costs = cost(args.rounds, args.steps)
    print(f"jdp.Audit on the bench MLP, 8 CPU devices, median of {args.rounds} rounds:")
    for backend, row in costs.items():
        ms = "  ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items())
        ratio = "  ".join(f"{k} {v:.3f}x" for k, v in row["ratio"].items())
        print(f"  {backend:9s} {ms}   ratio {ratio}")
    alarms = false_alarms(args.clean)
    print(f"false alarms in {args.clean} clean steps (tiny MLP, 8 devices, audit every step):")
    for name, count in alarms.items():
        print(f"  {name:24s} {count}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cost": costs, "false_alarms": alarms, "clean_steps": args.clean}, f)


if __name__ == "__main__":
    main()

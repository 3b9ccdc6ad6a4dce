"""`make bench`: what jdp.fit's timed steps cost (``time_every``, the device's phase stamps).

The bench MLP of benchmarks/run.py (784-512-512-10, Adam, global batch 512)
on 8 CPU devices under jdp.shard_map, for data_parallel and exact(8):

  plain      the step as given                                          (reference)
  timed@1    every call runs the timed twin (stamps at the step's start,
             before the first collective and after the reduction)
  timed@10   every 10th call runs it (fit's default with log_every=10)

Rounds are interleaved so machine noise hits every variant alike; each
figure is the median over rounds of the mean step time of ``--steps`` calls,
and the ratio is against plain in the same run.

Usage: python benchmarks/timing.py [--rounds 7] [--steps 50]
"""

import argparse
import statistics
import sys

import jdp

jdp.force_cpu_devices(8)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from benchmarks import run as bench  # noqa: E402
from jdp import _timed  # noqa: E402

STRATEGIES = {
    "data_parallel": jdp.strategies.data_parallel,
    "exact": lambda: jdp.strategies.exact(8),
}


def every(step, k):
    """A runner that calls the timed twin of ``step`` on every ``k``-th call, and ``step`` otherwise."""
    timed = _timed.Timed(step, k)
    calls = [0]

    def run(state, batch):
        calls[0] += 1
        if timed.due(calls[0]):
            return timed(lambda s, b, twin: twin(s, b), state, batch)
        return step(state, batch)

    return run, timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(
        f"fit's timed steps on the bench MLP, jdp.shard_map on 8 CPU devices, median of "
        f"{args.rounds} rounds of {args.steps} steps:"
    )
    for name, strategy in STRATEGIES.items():
        step = jdp.shard_map(jdp.make_train_step(bench.loss_fn, strategy=strategy()))
        runners = {"plain": step}
        clocks = []
        for k in (1, 10):
            runners[f"timed@{k}"], timed = every(step, k)
            clocks.append(timed)
        states, batches = bench.warmed(runners, step_of=lambda _, step=step: step)
        times = bench.time_rounds(runners, states, batches, args.rounds, args.steps)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        counted = [timed.totals()[2] for timed in clocks]
        cells = "  ".join(f"{k} {v:.2f} ms ({v / ms['plain']:.3f}x)" for k, v in ms.items())
        print(f"  {name:14s} {cells}   timed steps read: {counted}", flush=True)


if __name__ == "__main__":
    main()

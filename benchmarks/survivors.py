"""`make bench`: what the survivors' copy costs, and what a killed process costs with it.

Cost: the bench MLP of benchmarks/run.py (784-512-512-10, Adam, global batch
512) on 8 CPU devices, for each backend:

  donating  jdp.make_train_step(loss), the state donated to the next step (reference)
  kept      the same step with donate_state=False, each new state held by the
            survivors' copy as jdp.fit holds it (Checkpointer(local_directory=...));
            under shard_map written into an older state the copy let go of, as
            jdp.fit does (ShardMapStep.call_into)
  kept, new buffers
            (shard_map) the same, each new state in newly allocated buffers

Each backend is measured in ``--processes`` fresh processes of its own, as
a job runs one backend. Rounds are interleaved so machine noise hits every
variant alike; each figure is the median over rounds of the mean step time
of ``--steps`` calls; the ratio is the median over rounds of kept/donating
in the same round (goal: <= 1.05). The memory line is
the state's bytes per device and the copies the loop may hold.

Trials: ``--trials`` jobs of 4 processes x 2 devices in exact mode
(tests/scripts/preempt_run.py, 30 steps, checkpoints every 5) under
``jdp.launch --max-restarts 1 --elastic`` (``--backend``: under jdp.pmap or
jdp.shard_map, whose fit writes each state into a spare), each with a random process (1-3;
with ``--coordinator`` 0) SIGKILLed at a random step. A trial passes when the
survivors kept one step, no older than the killed process's last completed
one; the restart (on 2 processes) resumed at it and read the next batch
position first; and the final params and optimizer state equal the
uninterrupted run's bitwise. Printed: passes, steps lost, and the seconds
from the kill to the row of the first step after it (median, max).

Usage: python benchmarks/survivors.py [--rounds 15] [--steps 40] [--processes 3] [--trials 3]
       [--coordinator] [--seed 0] [--backend pmap|shard_map] [--json out.json]
"""

import argparse
import itertools
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import jdp

jdp.force_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import run as bench  # noqa: E402
from jdp import _recycle, _standby  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "preempt_run.py")
STEPS = 30
BACKENDS = {"pmap": jdp.pmap, "shard_map": jdp.shard_map}


class Kept:
    """A non-donating step whose every new state a Standby holds, as jdp.fit does.

    Where the backend recycles (jdp.shard_map), each step writes into the
    oldest state the Standby let go of, as in jdp.fit.
    """

    def __init__(self, step, folder, recycle=True):
        self.step, self.standby, self.count = step, _standby.Standby(folder, 0), 0
        self.run, self.recycle = None, recycle

    def __call__(self, state, batch):
        if self.run is None:
            self.run = _recycle.Spares(self.step, self.standby if self.recycle else None, state)
        state, metrics = self.run(state, batch)
        self.count += 1
        self.standby.keep(self.count, state, None, None)
        return state, metrics


def cost(backend, rounds, steps):
    """One backend's step times and kept/donating ratio, measured in this process."""
    folder = pathlib.Path(tempfile.mkdtemp())
    wrap = BACKENDS[backend]
    kept = wrap(jdp.make_train_step(bench.loss_fn), donate_state=False)
    runners = {"donating": wrap(jdp.make_train_step(bench.loss_fn)), "kept": Kept(kept, folder)}
    if kept.recycles:
        runners["kept, new buffers"] = Kept(kept.with_step(kept.step), folder, recycle=False)
    states, batches = bench.warmed(runners, lambda r: r.step if isinstance(r, Kept) else r)
    times = bench.time_rounds(runners, states, batches, rounds, steps)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    # Each round's ratio pairs two runs a few hundred ms apart: the machine's
    # slower drifts cancel in it.
    paired = [k / d for k, d in zip(times["kept"], times["donating"], strict=True)]
    state = jdp.unreplicate(states["donating"])
    nbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    return {"ms": ms, "ratio": statistics.median(paired), "state_bytes": int(nbytes)}


def cost_in_fresh_processes(rounds, steps, processes):
    """``{backend: [cost(...) of each process]}``: each backend in processes of its own.

    A job runs one backend; measured after the other backend's variants in
    one process, the shard_map ratio read 1.07-1.13 against 1.02-1.07 in
    processes of its own (the allocator's state after other work decides
    what the donating step's temporaries cost: with glibc's mmap threshold
    fixed at 4 MiB the ratio was 0.82-0.86).
    """
    out = {}
    for backend in BACKENDS:
        out[backend] = []
        for _ in range(processes):
            cmd = [sys.executable, __file__, "--cost-of", backend]
            cmd += ["--rounds", str(rounds), "--steps", str(steps)]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            if result.returncode:
                raise RuntimeError(result.stderr[-3000:])
            out[backend].append(json.loads(result.stdout.strip().splitlines()[-1]))
    return out


KEPT = re.compile(r"\[jdp\] process (\d) kept step (\d+)")


def job(directory, victim, at, backend):
    cmd = [sys.executable, "-m", "jdp.launch", "--processes", "4", "--devices-per-process", "2"]
    cmd += ["--max-restarts", "1", "--elastic", SCRIPT, str(directory), str(STEPS)]
    environ = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    environ |= {"PYTHONPATH": str(ROOT), "LOCAL": "1", "KILL_AT": f"{victim}:{at}"}
    environ |= {"RECORD": str(directory / "ids"), "BACKEND": backend}
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=600)


def reference(directory, backend):
    environ = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    environ |= {"PYTHONPATH": str(ROOT), "JDP_CPU_DEVICES_PER_PROCESS": "4", "BACKEND": backend}
    result = subprocess.run(
        [sys.executable, SCRIPT, str(directory), str(STEPS)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return np.load(directory / "final.npz")


def trial(directory, victim, at, expected, backend):
    """``(passed, steps lost, seconds from the kill to the next step's row, why)``."""
    result = job(directory, victim, at, backend)
    if result.returncode:
        return False, None, None, f"exit {result.returncode}: {result.stderr[-500:]}"
    kept = {int(s) for _, s in KEPT.findall(result.stderr)}
    if len(kept) != 1:
        return False, None, None, f"kept {kept}"
    (step,) = kept
    lost = max(at - step, 0)
    resumed = f"[jdp] resuming at step {step} from the survivors' copy" in result.stderr
    lines = (directory / "ids-0").read_text().splitlines()
    positions = [int(line.split(" ", 1)[0]) for line in lines]
    again = next((b for a, b in itertools.pairwise(positions) if b <= a), None)
    final = np.load(directory / "final.npz")
    bitwise = all(np.array_equal(final[k], expected[k]) for k in expected.files)
    killed_at = float((directory / f"killed-{victim}-{at}").read_text())
    rows = [line.split() for line in (directory / "steps-0").read_text().splitlines()]
    after = [float(t) for s, t in rows if int(s) > step and float(t) > killed_at]
    seconds = min(after) - killed_at if after else None
    passed = resumed and again == step + 1 and bitwise and lost == 0
    why = "" if passed else f"resumed {resumed}, first read {again}, bitwise {bitwise}"
    return passed, lost, seconds, why


def trials(count, coordinator, seed, backend):
    rng = np.random.default_rng(seed)
    root = pathlib.Path(tempfile.mkdtemp())
    (root / "reference").mkdir()
    expected = reference(root / "reference", backend)
    out = []
    for i in range(count):
        victim = 0 if coordinator else int(rng.integers(1, 4))
        at = int(rng.integers(6, 25))
        directory = root / f"trial{i}"
        directory.mkdir()
        passed, lost, seconds, why = trial(directory, victim, at, expected, backend)
        out.append({"victim": victim, "at": at, "passed": passed, "lost": lost, "s": seconds})
        sec = "-" if seconds is None else f"{seconds:.1f} s"
        print(
            f"  trial {i}: process {victim} killed at step {at}: {'ok' if passed else why}, {sec}"
        )
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per backend")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--coordinator", action="store_true", help="kill process 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="pmap", help="of the trials")
    parser.add_argument("--cost-of", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.cost_of:  # one fresh process's measurement, for cost_in_fresh_processes
        print(json.dumps(cost(args.cost_of, args.rounds, args.steps)))
        return
    costs = cost_in_fresh_processes(args.rounds, args.steps, args.processes)
    print(
        f"the survivors' copy on the bench MLP, 8 CPU devices, {args.processes} processes per "
        f"backend, each the median of {args.rounds} rounds of {args.steps} steps:"
    )
    for backend, rows in costs.items():
        for row in rows:
            ms = "  ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items())
            print(f"  {backend:9s} {ms}   ratio kept/donating {row['ratio']:.3f}")
        ratio = statistics.median(row["ratio"] for row in rows)
        print(f"  {backend:9s} median ratio kept/donating {ratio:.3f} (goal: <= 1.05)")
    mib = costs["pmap"][0]["state_bytes"] / 2**20
    print(
        f"  memory: the state is {mib:.1f} MiB per device; the loop holds at most "
        f"{_standby._KEPT} states (the newest completed one and two in flight) and the "
        f"buffers the next step writes, {_standby._KEPT} more than a donating step"
    )
    results = trials(args.trials, args.coordinator, args.seed, args.backend) if args.trials else []
    if results:
        seconds = [r["s"] for r in results if r["s"] is not None]
        passed = sum(r["passed"] for r in results)
        lost = sum(r["lost"] or 0 for r in results)
        print(
            f"killed trials: {passed}/{len(results)} passed, {lost} steps lost; kill -> next "
            f"step's row: median {statistics.median(seconds):.1f} s, max {max(seconds):.1f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cost": costs, "trials": results}, f)


if __name__ == "__main__":
    main()

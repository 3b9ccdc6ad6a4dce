"""How well jdp names a slow process: detection within 50 steps, false alarms on clean runs.

Runs tests/scripts/multiprocess_pace.py under jdp.launch: TRIALS jobs in which the
last process's data loader is slowed by SLOWDOWN (0.1: 10% of its own step time)
from step 21, and one clean job of CLEAN steps, for each layout (processes x
devices per process). Prints how many slowed jobs named the slowed process
within 50 steps, the steps it took, and how many times a clean job named anyone.

Usage: python benchmarks/pace.py [--trials 20] [--clean 2000] [--layouts 2x4 4x2]
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "multiprocess_pace.py")
NAMED = re.compile(
    r"process (\d+) of \d+ on \S+ \(devices [\d, ]+\) sets the job's pace: "
    r"it waited [\d.]+ ms per step for its data in steps \d+-(\d+)"
)


def job(layout, mode, steps, slowdown):
    processes, devices = (int(v) for v in layout.split("x"))
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "jdp.launch",
        "--processes",
        str(processes),
        "--devices-per-process",
        str(devices),
        SCRIPT,
        mode,
        str(steps),
        str(slowdown),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    return processes, [(int(p), int(s)) for p, s in NAMED.findall(run.stderr)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--clean", type=int, default=2000, help="steps of the clean job")
    parser.add_argument("--slowdown", type=float, default=0.1)
    parser.add_argument("--layouts", nargs="+", default=["2x4", "4x2"])
    args = parser.parse_args()
    print(f"\nstragglers: a data loader slowed by {args.slowdown:.0%} from step 21")
    for layout in args.layouts:
        found = []
        for _ in range(args.trials):
            processes, named = job(layout, "slow", 90, args.slowdown)
            right = [s - 20 for p, s in named if p == processes - 1]
            found.append(right[0] if right and right[0] <= 50 else None)
        hits = [f for f in found if f is not None]
        after = f", median {statistics.median(hits):.0f} steps after it began" if hits else ""
        _, false = job(layout, "clean", args.clean, 0.0)
        print(
            f"{layout}: named within 50 steps in {len(hits)} of {args.trials} trials{after}; "
            f"{len(false)} false alarm(s) over {args.clean} clean steps",
            flush=True,
        )


if __name__ == "__main__":
    main()

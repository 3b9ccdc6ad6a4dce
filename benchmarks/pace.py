"""How well jdp names a slow or a hung process: detection within 50 steps, false alarms, hangs.

Runs tests/scripts/multiprocess_pace.py under jdp.launch, for each layout
(processes x devices per process):

- for each of MODES, TRIALS jobs in which the last process is slowed by
  SLOWDOWN (0.1: 10% of its own step time) from step 21, in its data loader
  (``slow``) or inside its loss, on the device's side of the step
  (``slow-loss``), and one clean job of CLEAN steps: how many slowed jobs
  named the slowed process within 50 steps, the steps it took, and how many
  times a clean job named anyone;
- HANGS jobs in which the last process's step blocks in a host callback at
  step 8 (``--timeout 10``): how many named that process and ended within
  the deadline + 10 s of the hang, and the median time from hang to end.
  With ``--launchers``, as many 2 x 2 jobs started by each of ``mpirun``,
  ``srun`` (a SLURM controller must answer) and ``k8s`` (a Kubernetes Indexed
  Job's variables, each process started on its own), as the suite starts them.

With ``--time-every K`` the jobs time every K steps on the device (``jdp.fit``'s
``time_every``), which ``slow-loss`` needs to be seen.

Usage: python benchmarks/pace.py [--trials 20] [--modes slow slow-loss] [--time-every 1]
       [--clean 2000] [--hangs 20] [--layouts 2x4 4x2] [--launchers mpirun srun k8s]
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests import launching, test_pace  # noqa: E402  (the suite's launchers for the 2 x 2 job)

LAUNCHERS = {"mpirun": "mpirun", "srun": "srun", "k8s": "jobset"}
SCRIPT = str(ROOT / "tests" / "scripts" / "multiprocess_pace.py")
NAMED = re.compile(
    r"process (\d+) of \d+ on \S+ \(devices [\d, ]+\) sets the job's pace: "
    r"it waited [\d.]+ ms per step for its data(?: and computed [\d.]+ ms before the first "
    r"collective)? in steps \d+-(\d+)"
)


HELD = re.compile(r"the job waits for process\(es\) \[(\d+)\], inside a host callback")
DEADLINE = 10.0


def launched(layout, mode, steps, slowdown, *options, time_every=0):
    """``(processes, the finished jdp.launch run, the time it ended)``."""
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
        *options,
        SCRIPT,
        mode,
        str(steps),
        str(slowdown),
        str(time_every),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    return processes, run, time.time()


def job(layout, mode, steps, slowdown, time_every=0):
    processes, run, _ = launched(layout, mode, steps, slowdown, time_every=time_every)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    return processes, [(int(p), int(s)) for p, s in NAMED.findall(run.stderr)]


def hang(layout):
    """Seconds from the hang to the job's end when the hung process was named and the job failed, else None."""
    processes, run, ended = launched(layout, "hang-step", 100, 0.0, "--timeout", str(DEADLINE))
    began = re.search(r"hanging at ([\d.]+)", run.stderr)
    named = {int(p) for p in HELD.findall(run.stderr)}
    if run.returncode == 0 or began is None or named != {processes - 1}:
        return None
    return ended - float(began.group(1))


def hang_under(launcher):
    """:func:`hang` for the suite's 2 x 2 job started by ``launcher`` (a key of LAUNCHERS)."""
    code, err, ended = test_pace.launch(
        "hang-step", 100, timeout=int(DEADLINE), launcher=LAUNCHERS[launcher]
    )
    began = re.search(r"hanging at ([\d.]+)", err)
    if code == 0 or began is None or {int(p) for p in HELD.findall(err)} != {1}:
        return None
    return ended - float(began.group(1))


def report(where, ends, jobs):
    good = [e for e in ends if e is not None and e <= DEADLINE + 10]
    median = f", median {statistics.median(good):.1f} s from hang to end" if good else ""
    print(
        f"{where}: named and ended within {DEADLINE + 10:.0f} s in {len(good)} of {jobs} jobs{median}",
        flush=True,
    )


def stragglers(layout, mode, args):
    """How many of ``args.trials`` jobs named the slowed process within 50 steps, and when."""
    found = []
    for _ in range(args.trials):
        processes, named = job(layout, mode, 90, args.slowdown, args.time_every)
        right = [s - 20 for p, s in named if p == processes - 1]
        found.append(right[0] if right and right[0] <= 50 else None)
    hits = [f for f in found if f is not None]
    after = f", median {statistics.median(hits):.0f} steps after it began" if hits else ""
    return f"named within 50 steps in {len(hits)} of {args.trials} trials{after}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--modes", nargs="*", default=["slow"])
    parser.add_argument(
        "--time-every", type=int, default=0, help="fit's time_every (slow-loss needs it)"
    )
    parser.add_argument("--clean", type=int, default=2000, help="steps of the clean job")
    parser.add_argument("--slowdown", type=float, default=0.1)
    parser.add_argument("--hangs", type=int, default=20, help="jobs hung in a host callback")
    parser.add_argument("--layouts", nargs="*", default=["2x4", "4x2"])
    parser.add_argument("--launchers", nargs="*", default=[], choices=sorted(LAUNCHERS))
    args = parser.parse_args()
    if args.trials:  # 0: the hangs only
        print(f"\nstragglers: the last process slowed by {args.slowdown:.0%} from step 21")
        for layout in args.layouts:
            for mode in args.modes:
                print(f"{layout} {mode}: {stragglers(layout, mode, args)}", flush=True)
            _, false = job(layout, "clean", args.clean, 0.0, args.time_every)
            print(
                f"{layout}: {len(false)} false alarm(s) over {args.clean} clean steps", flush=True
            )
    if args.hangs:
        print(
            f"\nhangs: the last process's step blocks in a host callback (deadline {DEADLINE:.0f} s)"
        )
        for layout in args.layouts:
            report(layout, [hang(layout) for _ in range(args.hangs)], args.hangs)
        for launcher in args.launchers:
            if launcher == "srun" and not launching.slurm_up():
                print("2x2 under srun: skipped, no SLURM controller answers", flush=True)
                continue
            ends = [hang_under(launcher) for _ in range(args.hangs)]
            report(f"2x2 under {launcher}", ends, args.hangs)


if __name__ == "__main__":
    main()

"""How fast a multi-process job ends when a process fails, stalls or is terminated.

For each launcher found here (jdp.launch; Open MPI's mpirun; SLURM's srun when
a controller answers; SLURM's variables without srun; the variables a Kubernetes
Indexed Job or JobSet exports), a 2 processes x 2 CPU
devices job (tests/scripts/multiprocess_failfast.py):

  2x2 vs 1x4   largest parameter difference from one process of 4 devices
  raise        process 1 raises while loading step 3's batch: seconds from the
               raise to the last process ending, exit codes, the process named
  early        process 1 leaves the loop after 3 steps, deadline 30 s: seconds
               from its leaving to the end, whether it is named
  SIGTERM      the launcher (or each SLURM task) is sent SIGTERM: seconds to the
               end, processes left running

Run: python benchmarks/failfast.py   (about 3 minutes)
"""

import pathlib
import signal
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests import test_failfast as job


def launchers():
    found = ["jdp.launch"]
    if job.shutil.which("mpirun"):
        found.append("mpirun")
    if job._slurm_up():
        found.append("srun")
    return [*found, "slurm", "jobset"]


def parity(launcher, tmp, reference):
    job.finish(job.start(launcher, "ok", tmp / "two"), 300)
    two, one = np.load(tmp / "two.npz"), np.load(reference)
    return max(float(np.max(np.abs(two[k] - one[k]))) for k in one.files)


def failing(launcher, tmp, mode, **extra):
    codes, err, ended = job.finish(job.start(launcher, mode, tmp / mode, **extra), 300)
    since = float((tmp / f"{mode}-1.failed_at").read_text())
    host = socket.gethostname()
    named = f"process 1 of 2 on {host} failed" in err or "process 1: finished" in err
    return ended - since, codes, named


def terminated(launcher, tmp):
    procs = job.start(launcher, "sleep", tmp / "term")
    while len(list(tmp.glob("term-*.pid"))) < 2:
        time.sleep(0.2)
    time.sleep(3)
    sent = time.time()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    _, _, ended = job.finish(procs, 120)
    left = sum(job.alive(int(f.read_text())) for f in tmp.glob("term-*.pid"))
    return ended - sent, left


def main():
    print(__doc__.split("\n\n")[0])
    print(
        f"{'launcher':<12} {'2x2 vs 1x4':>11} {'raise s':>8} {'rc':>10} {'named':>6} "
        f"{'early s':>8} {'named':>6} {'SIGTERM s':>10} {'left':>5}"
    )
    with tempfile.TemporaryDirectory() as root:
        started = time.time()
        codes, _, ended = job.finish(job.start("alone", "ok", pathlib.Path(root) / "one"), 300)
        print(
            f"{'no launcher':<12} one process of 4 devices: exit codes {codes}, "
            f"{ended - started:.1f} s"
        )
        for launcher in launchers():
            tmp = pathlib.Path(tempfile.mkdtemp(dir=root))
            diff = parity(launcher, tmp, pathlib.Path(root) / "one.npz")
            raise_s, codes, named = failing(launcher, tmp, "raise")
            early_s, _, early_named = failing(launcher, tmp, "short", JDP_TIMEOUT="30")
            term_s, left = terminated(launcher, tmp)
            print(
                f"{launcher:<12} {diff:>11.1e} {raise_s:>8.1f} {codes!s:>10} {named!s:>6} "
                f"{early_s:>8.1f} {early_named!s:>6} {term_s:>10.1f} {left:>5}",
                flush=True,
            )


if __name__ == "__main__":
    main()

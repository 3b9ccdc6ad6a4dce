"""Kill anywhere, resume anywhere: the acceptance run of issue #23.

TRIALS exact-mode jobs (tests/scripts/preempt_run.py, 30 steps, checkpoints every 5),
each killed KILLS times at random (half: a worker SIGKILLed after a random
step; half: the launcher SIGKILLed from outside at a random instant) and
relaunched on a random layout among 1x4, 2x2 and 4x1 processes x devices,
then run to the end. Prints each trial's kill points and layouts and whether
its final params and optimizer state are bitwise those of the uninterrupted
run (sha256 of the arrays).

Run: python benchmarks/kill_anywhere.py [TRIALS] [KILLS]   (default 10 x 2: 20 kills)
"""

import hashlib
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tests import test_restarts as job


def digest(directory):
    final = np.load(directory / "final.npz")
    return hashlib.sha256(b"".join(final[k].tobytes() for k in final.files)).hexdigest()[:16]


def main(trials=10, kills=2):
    rng = np.random.default_rng(2026)
    with tempfile.TemporaryDirectory() as root:
        reference = pathlib.Path(root) / "reference"
        reference.mkdir()
        assert job.run(job.alone(reference)).returncode == 0
        expected = digest(reference)
        print(f"uninterrupted run (1 process x 4 devices): sha256 {expected}")
        equal = 0
        for trial in range(trials):
            directory = pathlib.Path(root) / f"trial{trial}"
            directory.mkdir()
            history = job.kill_and_resume(directory, rng, kills)
            got = digest(directory)
            equal += got == expected
            runs = "; ".join(f"{p}x{4 // p} {what}" for p, what in history)
            print(
                f"trial {trial}: {runs} -> {got} {'equal' if got == expected else 'DIFFERENT'}",
                flush=True,
            )
        print(f"{equal}/{trials} trials ({trials * kills} kills) bitwise equal")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))

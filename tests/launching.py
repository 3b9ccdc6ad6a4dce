"""Starting a script under jdp.launch from a test, as a user would on one machine."""

import os
import shutil
import subprocess
import sys

import pytest

# Open MPI on loopback only, in shared memory between local ranks.
MPIRUN_ENV = {"OMPI_MCA_btl": "self,vader", "OMPI_MCA_oob_tcp_if_include": "lo"}
MPIRUN = pytest.param(
    "mpirun", marks=pytest.mark.skipif(not shutil.which("mpirun"), reason="no mpirun")
)


def slurm_up() -> bool:
    """A SLURM controller answers with an idle node (a one-node setup will do)."""
    if not shutil.which("sinfo"):
        return False
    try:
        run = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "idle" in run.stdout or "mix" in run.stdout


SRUN = pytest.param("srun", marks=pytest.mark.skipif(not slurm_up(), reason="no SLURM"))


def launch_command(*args: str, processes: int = 2, devices: int = 2) -> list[str]:
    """``python -m jdp.launch --processes P --devices-per-process D ARGS...``."""
    flags = ["--processes", str(processes), "--devices-per-process", str(devices)]
    return [sys.executable, "-m", "jdp.launch", *flags, *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the thread-count variables a launched job sets itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    return env | extra


def mpirun_command(*args: str, exported: list[str], processes: int = 2) -> list[str]:
    """``mpirun -np P -x NAME... python ARGS...``; root is allowed, as CI runs as root."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(processes)]
    cmd += [arg for name in exported for arg in ("-x", name)]
    return [*cmd, sys.executable, *args]

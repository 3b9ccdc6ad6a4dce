"""Starting a script under jdp.launch from a test, as a user would on one machine."""

import os
import sys


def launch_command(*args: str, processes: int = 2, devices: int = 2) -> list[str]:
    """``python -m jdp.launch --processes P --devices-per-process D ARGS...``."""
    flags = ["--processes", str(processes), "--devices-per-process", str(devices)]
    return [sys.executable, "-m", "jdp.launch", *flags, *args]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the thread-count variables a launched job sets itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    return env | extra

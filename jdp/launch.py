"""Start N local processes of a jdp script, for laptops and tests.

    python -m jdp.launch --processes 2 --devices-per-process 4 train.py [args]

Each process gets a coordinator on 127.0.0.1 at a free port and the
variables ``jdp.distributed.initialize()`` reads; its output lines are
prefixed with its index. If any process fails, the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher exits with the
failing code. Clusters use their own launchers (srun, mpirun, Kubernetes).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jdp.distributed import ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

GRACE_SECONDS = 5.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix}{line}")
        sink.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(script: str, args: list[str], processes: int, devices_per_process: int) -> int:
    """Runs ``script`` in ``processes`` processes; returns the job's exit code."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs, pumps = [], []
    for i in range(processes):
        env = {
            **os.environ,
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(processes),
            ENV_PROCESS_ID: str(i),
            ENV_CPU_DEVICES: str(devices_per_process),
            "PYTHONUNBUFFERED": "1",
        }
        p = subprocess.Popen(
            [sys.executable, script, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, so stopping it stops its children
        )
        procs.append(p)
        for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[{i}] ", sink), daemon=True)
            t.start()
            pumps.append(t)
    code = 0
    try:
        while [p.poll() for p in procs].count(None):  # poll every process, every time
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                index = procs.index(failed[0])
                sys.stderr.write(
                    f"[launch] process {index} exited with {code}; stopping the others\n"
                )
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=2)
    if code == 0:
        code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return 1 if code < 0 else code


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m jdp.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--processes", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process", type=int, default=1, help="CPU devices forced in each process"
    )
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.processes < 1 or ns.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    sys.exit(launch(ns.script, ns.args, ns.processes, ns.devices_per_process))


if __name__ == "__main__":
    main()

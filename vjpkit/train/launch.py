"""Runs a script as N local processes of one ``jax.distributed`` job: for tests and trying it out.

Usage::

    python -m vjpkit.train.launch -n 2 --cpu-devices 2 train.py --steps 20

starts ``train.py --steps 20`` ``n`` times with a free coordinator port on ``127.0.0.1`` and
``VJPKIT_COORDINATOR``, ``VJPKIT_NUM_PROCESSES`` and ``VJPKIT_PROCESS_ID`` in each one's
environment; the script calls ``vjpkit.train.initialize()`` first. ``--cpu-devices D`` gives each
process D CPU devices (``JAX_NUM_CPU_DEVICES``, ``JAX_PLATFORMS=cpu``). Every line a process
prints is forwarded with its number, ``[1] loss 0.52``. The launcher waits for all of them; when
one fails, it stops the others (a process left alone would wait for it forever in the next
collective) and exits with the failed process's code. On several hosts, start one process per
host yourself (or with Slurm's ``srun``): see docs/training-scale.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ._distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

__all__ = ["launch", "main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward(i: int, stream, out, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"[{i}] {line}")
            out.flush()


def launch(
    command: Sequence[str],
    processes: int,
    *,
    cpu_devices: int | None = None,
    port: int | None = None,
    timeout: float | None = None,
    env: dict | None = None,
    out=None,
) -> int:
    """Runs ``python *command`` as ``processes`` processes of one job; returns the exit code.

    Args:
        command: the script and its arguments (``["train.py", "--steps", "20"]``), run with
            this Python (``["-m", "pkg.mod", ...]`` runs a module).
        processes: how many processes.
        cpu_devices: CPU devices per process (``JAX_NUM_CPU_DEVICES``), or ``None`` to leave
            the platform to JAX.
        port: the coordinator's port on ``127.0.0.1`` (default: a free one).
        timeout: seconds before every process is stopped and the launch fails (default: none).
        env: the environment of the processes (default: this one's).
        out: where the prefixed output goes (default ``sys.stdout``).

    Returns:
        0 when every process exits with 0; otherwise the first failure's exit code (a process
        ended by a signal gives ``128 + signal``, ``124`` a timeout). The others are stopped.
    """
    if processes < 1:
        raise ValueError(f"launch: processes must be >= 1, got {processes}")
    out = sys.stdout if out is None else out
    base = dict(os.environ if env is None else env)
    base[COORDINATOR] = f"127.0.0.1:{port or _free_port()}"
    base[NUM_PROCESSES] = str(processes)
    if cpu_devices is not None:
        base["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        base["JAX_PLATFORMS"] = "cpu"
    lock = threading.Lock()
    procs, threads = [], []
    for i in range(processes):
        proc = subprocess.Popen(
            [sys.executable, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**base, PROCESS_ID: str(i)},
        )
        procs.append(proc)
        threads.append(threading.Thread(target=_forward, args=(i, proc.stdout, out, lock), daemon=True))
        threads[-1].start()
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while code == 0 and [p.poll() for p in procs].count(None):  # polls every process
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                i, rc = failed[0]
                code = 128 - rc if rc < 0 else rc
                print(f"launch: process {i} exited with code {rc}; stopping the others", file=sys.stderr)
            elif deadline is not None and time.monotonic() > deadline:
                code = 124
                print(f"launch: timeout after {timeout} s; stopping every process", file=sys.stderr)
            else:
                time.sleep(0.05)
        if code == 0:
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
            if failed:
                i, rc = failed[0]
                code = 128 - rc if rc < 0 else rc
                print(f"launch: process {i} exited with code {rc}", file=sys.stderr)
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()
            p.wait()
        for t in threads:
            t.join(timeout=5)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vjpkit.train.launch",
        description="Run a script as N local processes of one jax.distributed job.",
    )
    parser.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    parser.add_argument("--cpu-devices", type=int, default=None, help="CPU devices per process")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the launch fails")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args ...]")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the script to run: python -m vjpkit.train.launch -n 2 train.py")
    return launch(
        args.command, args.processes, cpu_devices=args.cpu_devices, port=args.port, timeout=args.timeout
    )


if __name__ == "__main__":
    sys.exit(main())

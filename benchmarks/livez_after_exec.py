"""How long a restarted daemon takes to answer /livez, and how much of it is its own
(a benchmark, not a test).

Spawns ``python -m kvd serve`` on free ports, polls ``/livez`` every 10 ms and reads the
main thread's scheduler counters before each poll (``/proc/PID/task/PID/schedstat``):
the time it ran on a CPU and the time it sat runnable waiting for one. On a shared host
the wall time is mostly that wait; the CPU time is the daemon's own work.

    .venv/bin/python benchmarks/livez_after_exec.py --runs 5 [--tree DIR ...]

Each ``--tree`` is a kvd checkout imported through PYTHONPATH (the default: the
installed kvd); trees take turns run by run. Set PYTHONPYCACHEPREFIX to a scratch
folder to compare trees with cached bytecode without writing into them.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _schedstat(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        run_ns, wait_ns, _ = f.read().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def once(tree: str) -> tuple[float, float, float]:
    """(wall, ran, waited) seconds from exec to the first 200 on /livez."""
    metrics = _free_port()
    env = dict(os.environ, **({"PYTHONPATH": tree} if tree else {}))
    args = [sys.executable, "-m", "kvd", "serve",
            "--engine-address", f"tcp://127.0.0.1:{_free_port()}",
            "--peer-address", f"tcp://127.0.0.1:{_free_port()}",
            "--metrics-port", str(metrics), "--set", f"shm_prefix=kvd-lz{os.getpid()}"]
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, cwd=cwd)
        try:
            ran = waited = 0.0
            while time.monotonic() - t0 < 60:
                try:
                    ran, waited = _schedstat(proc.pid)
                except OSError:
                    pass
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/livez",
                                                timeout=0.5) as resp:
                        if resp.status == 200:
                            return time.monotonic() - t0, ran, waited
                except OSError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit(f"kvd serve exited with {proc.returncode}")
                time.sleep(0.01)
            raise SystemExit("/livez did not answer within 60 s")
        finally:
            proc.terminate()
            proc.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", action="append", default=[])
    opts = ap.parse_args()
    trees = opts.tree or [""]
    got: dict[str, list[tuple[float, float, float]]] = {t: [] for t in trees}
    for _ in range(opts.runs):
        for tree in trees:
            got[tree].append(once(tree))
    for tree, rows in got.items():
        cols = list(zip(*rows, strict=True))
        print(f"{tree or 'installed kvd'}: wall {' '.join(f'{x:.2f}' for x in cols[0])} | "
              f"ran {' '.join(f'{x:.2f}' for x in cols[1])} | "
              f"waited {' '.join(f'{x:.2f}' for x in cols[2])} | "
              f"median ran {statistics.median(cols[1]):.2f} s")


if __name__ == "__main__":
    main()

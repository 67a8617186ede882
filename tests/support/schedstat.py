"""How long a process waited for a CPU: the part of its wall time that the host, not
kvd, decided.

Linux counts, per thread, the time it ran and the time it sat runnable on a run queue
waiting for a CPU (``/proc/PID/task/TID/schedstat``: run ns, wait ns, slices). On a host
that other work shares, a process's wall time is its own work (CPU, sleeps, waits kvd
chose) plus that queueing; a bound on "wall time minus queueing" judges what kvd
controls and still fails when kvd sleeps, blocks or retries where it should not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def run_queue_wait_s(pid: int) -> float:
    """Seconds the main thread of ``pid`` waited runnable for a CPU (0 where the kernel
    keeps no schedstat: the bound then judges plain wall time)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except OSError:
        return 0.0
    return int(fields[1]) / 1e9


def own_time_until(pid: int, ready: Callable[[], bool], timeout_s: float,
                   poll_s: float = 0.01) -> tuple[float, float]:
    """Poll ``ready`` until it holds; returns (wall seconds, those seconds less the time
    ``pid``'s main thread waited for a CPU meanwhile). The wait is read before each
    poll, so the one subtracted is at most the true one (never flatters kvd)."""
    start = time.monotonic()
    wait0 = run_queue_wait_s(pid)
    while time.monotonic() - start < timeout_s:
        waited = run_queue_wait_s(pid) - wait0
        if ready():
            wall = time.monotonic() - start
            return wall, max(0.0, wall - waited)
        time.sleep(poll_s)
    raise AssertionError(f"not ready after {timeout_s}s")

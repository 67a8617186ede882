"""Turns of ``kvd bench vllm``: only the measured system runs, the others are paused.

Every system of a run (its engines, their daemons, its router) stays up for the whole
run, but between its turns each of its processes is stopped (SIGSTOP) and for its turn
continued (SIGCONT, then a short settle), so that a turn runs with only that system on
the CPUs while the turns still alternate. vLLM's NixlConnector as shipped spins NIXL's
progress thread in every idle engine (~0.8 core each): without the pauses no run with
it is on a quiet host. A system is paused and continued as a whole, daemons and engines
together (daemons continued first, engines paused first): a daemon moves its engines'
silence and its leases on by a stall of its own (``kvd.daemon.clock.StallGap``), so a
pause retires nobody (``tests/daemon/engines/test_stall_processes.py``: both frozen
together retire nobody).

``--hog N`` runs N busy loops for the whole run (the busy-host runs). Each turn records
the host's load while it ran: the runnable threads (``/proc/loadavg``), the host's busy
cores (``/proc/stat``), and what of it the system, the hogs and everything else
(other users of the host) used.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

SETTLE_S = 1.0  # after continuing a system, before its turn starts
SAMPLE_S = 0.25  # the load sampler's period during a turn
CLK_TCK = os.sysconf("SC_CLK_TCK")
HOG_CODE = "while True: pass"


@dataclass(frozen=True)
class Group:
    """One system's processes, by session id (each was started in a session of its own):
    ``daemons`` continue before ``engines`` and stop after them."""

    daemons: tuple[int, ...]
    engines: tuple[int, ...]  # its engines' servers and its router


@dataclass
class TurnLoad:
    system: str
    wall_s: float
    runnable: list[int] = field(default_factory=list)  # /proc/loadavg's running threads
    load_1m: list[float] = field(default_factory=list)
    host_cores: float = 0.0  # busy cores of the whole host during the turn
    system_cores: float = 0.0  # of which the system's processes
    hog_cores: float = 0.0  # ... the hogs
    client_cores: float = 0.0  # ... the bench itself (the HTTP client)

    @property
    def others_cores(self) -> float:
        """Busy cores nobody of this run accounts for: other users of the host."""
        return max(0.0, self.host_cores - self.system_cores - self.hog_cores
                   - self.client_cores)


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry))
    return out


def cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes (the gone ones count 0)."""
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def host_busy_s() -> float:
    """CPU seconds the host has been busy (every core, /proc/stat's first line)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    return (sum(parts[:8]) - idle) / CLK_TCK


def runnable_now() -> tuple[int, float]:
    """(threads running or runnable now, 1-minute load average)."""
    with open("/proc/loadavg") as f:
        parts = f.read().split()
    return int(parts[3].split("/")[0]), float(parts[0])


def signal_sessions(sids: Sequence[int], sig: int) -> None:
    for sid in sids:
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def is_stopped(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] in ("T", "t")


class Turns:
    """Which system runs now; the others stay stopped. ``turn(name)`` continues it
    (pausing the one that ran before) and records the host's load while it runs."""

    def __init__(self, groups: dict[str, Group], settle_s: float = SETTLE_S,
                 hog_pids: Callable[[], Sequence[int]] = tuple,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.groups = dict(groups)
        self.settle_s = settle_s
        self._hog_pids = hog_pids
        self._sleep = sleep
        self.running: set[str] = set(groups)  # everything runs after the start
        self.loads: list[TurnLoad] = []

    def pause(self, name: str) -> None:
        g = self.groups[name]
        signal_sessions(g.engines, signal.SIGSTOP)
        signal_sessions(g.daemons, signal.SIGSTOP)
        self.running.discard(name)

    def resume(self, name: str) -> None:
        g = self.groups[name]
        signal_sessions(g.daemons, signal.SIGCONT)
        signal_sessions(g.engines, signal.SIGCONT)
        self.running.add(name)

    def drop(self, name: str) -> None:
        """A system that failed: no more turns (the caller stops its processes)."""
        if name in self.groups:
            self.resume(name)  # a stopped process does not act on SIGTERM
            del self.groups[name]
            self.running.discard(name)

    def resume_all(self) -> None:
        for name in list(self.groups):
            self.resume(name)

    @contextlib.contextmanager
    def turn(self, name: str) -> Iterator[None]:
        for other in sorted(self.running - {name}):
            self.pause(other)
        if name not in self.running:
            self.resume(name)
            self._sleep(self.settle_s)
        sids = [*self.groups[name].daemons, *self.groups[name].engines]
        pids = [p for s in sids for p in session_pids(s)]
        hogs = list(self._hog_pids())
        load = TurnLoad(name, 0.0)
        stop = threading.Event()

        def sample() -> None:
            while True:
                r, l1 = runnable_now()
                load.runnable.append(max(0, r - 1))  # the sampler itself runs
                load.load_1m.append(l1)
                if stop.wait(SAMPLE_S):
                    return

        sampler = threading.Thread(target=sample, daemon=True, name="turn-load")
        t0, host0, own0, hog0 = time.monotonic(), host_busy_s(), cpu_s(pids), cpu_s(hogs)
        client0 = time.process_time()
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            sampler.join()
            load.wall_s = time.monotonic() - t0
            if load.wall_s > 0:
                w = load.wall_s
                load.host_cores = (host_busy_s() - host0) / w
                load.system_cores = (cpu_s(pids) - own0) / w
                load.hog_cores = (cpu_s(hogs) - hog0) / w
                load.client_cores = (time.process_time() - client0) / w
            self.loads.append(load)

    def summary(self) -> dict[str, Any]:
        """Per system, over all its turns: the time its turns took, the median and max
        runnable threads, and the mean busy cores of the host, of the system, of the
        hogs and of everything else (time-weighted)."""
        out: dict[str, Any] = {}
        for name in dict.fromkeys(t.system for t in self.loads):
            turns = [t for t in self.loads if t.system == name]
            wall = sum(t.wall_s for t in turns) or 1.0
            runnable = [r for t in turns for r in t.runnable] or [0]
            load_1m = [x for t in turns for x in t.load_1m] or [0.0]

            def mean(attr: str, ts: list[TurnLoad] = turns, w: float = wall) -> float:
                return round(sum(getattr(t, attr) * t.wall_s for t in ts) / w, 3)

            out[name] = {"turns": len(turns), "turn_s": round(wall, 1),
                         "runnable_p50": statistics.median(runnable),
                         "runnable_max": max(runnable),
                         "load_1m_p50": round(statistics.median(load_1m), 2),
                         "host_cores": mean("host_cores"),
                         "system_cores": mean("system_cores"),
                         "hog_cores": mean("hog_cores"),
                         "others_cores": mean("others_cores")}
        return out


class Hogs:
    """N busy loops (``python -c 'while True: pass'``), each in a session of its own."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", HOG_CODE],
                                       start_new_session=True) for _ in range(n)]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

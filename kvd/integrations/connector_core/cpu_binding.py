"""Warn when vLLM's CPU thread binding pins two engines' workers to the same cores.

Why: vLLM's CPU backend binds each worker (``VLLM_CPU_OMP_THREADS_BIND=auto``)
to the cores it picks for local rank 0, the same cores for every engine of a host, and
every thread the worker starts inherits the mask. A worker waiting for its next step
spins in ``sched_yield`` (vLLM's shm message queue). Traced on Linux 6.18: a prefill
worker spinning that way, waiting for its sends, kept its core for 30 s while the decode
worker pinned to the same core sat runnable and got 6 ms of it; the kernel charged the
spinner's group no virtual runtime, so the decode group never became eligible. The
decode step took 30 s, and the prefill leases expired before the decode read them. Each
engine on its own cores, or ``nobind``, never stalled.

The check is cheap (a /proc scan once, when the worker registers) and only warns: the
binding is vLLM's, set before the connector exists. Only the engine that registers
second sees the first; each engine pins its worker before it loads the model, long
before it registers, so two engines started together still meet.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvd.vllm")

WORKER_COMM = "VLLM::Worker"  # the process title vLLM gives its workers


@dataclass(frozen=True)
class Worker:
    """A vLLM worker process: its engine (the parent, vLLM's EngineCore) and its cores."""

    pid: int
    parent_pid: int
    cpus: frozenset[int]
    parent_cpus: frozenset[int]

    @property
    def pinned(self) -> bool:
        """Bound to fewer cores than its engine core may use: vLLM's binding, not a cpuset
        (a container's cpuset limits the engine core as well)."""
        return bool(self.cpus) and self.cpus < self.parent_cpus


def pinned_neighbours(own: Worker, others: Iterable[Worker]) -> list[Worker]:
    """Workers of other engines pinned to a core ``own`` is pinned to. Empty when ``own``
    is not pinned: the kernel then moves it to whichever core is free."""
    if not own.pinned:
        return []
    return [w for w in others
            if w.pid != own.pid and w.parent_pid != own.parent_pid and w.pinned
            and w.cpus & own.cpus]


def _read_worker(proc: Path, pid: int, any_title: bool = False) -> Worker | None:
    try:
        if not any_title and (proc / str(pid) / "comm").read_text().strip() != WORKER_COMM:
            return None
        ppid = int((proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        return Worker(pid, ppid, _cpus(proc, pid), _cpus(proc, ppid))
    except (OSError, ValueError, IndexError):
        return None  # gone meanwhile, or not ours to read


def _cpus(proc: Path, pid: int) -> frozenset[int]:
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    return frozenset()


def parse_cpu_list(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def scan(pid: int, proc: Path = Path("/proc")) -> tuple[Worker | None, list[Worker]]:
    """(the worker ``pid``, every vLLM worker on the host) from /proc."""
    workers = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            w = _read_worker(proc, int(entry.name))
            if w is not None:
                workers.append(w)
    # The caller may not carry vLLM's title (scheduler-level tests build workers in-process).
    own = next((w for w in workers if w.pid == pid), None) or _read_worker(proc, pid, True)
    return own, workers


def warn_if_shared(pid: int | None = None, proc: Path = Path("/proc")) -> str | None:
    """Log (and return) a warning when this worker shares a pinned core with another
    engine's pinned worker; ``None`` when it does not or /proc cannot tell."""
    try:
        own, workers = scan(os.getpid() if pid is None else pid, proc)
    except OSError:
        return None
    if own is None:
        return None
    shared = pinned_neighbours(own, workers)
    if not shared:
        return None
    msg = (f"vLLM pinned this engine's worker (pid {own.pid}) to CPUs {_fmt(own.cpus)}, and "
           "another engine's worker is pinned to the same cores ("
           + ", ".join(f"pid {w.pid}: CPUs {_fmt(w.cpus)}" for w in shared)
           + "). A worker waiting for its next step spins in sched_yield; pinned together, "
           "one engine's worker was seen to get no CPU for 30 s, past the prefill leases. "
           "Give each engine its own cores (VLLM_CPU_OMP_THREADS_BIND=0-7 for one engine, "
           "8-15 for the other) or set VLLM_CPU_OMP_THREADS_BIND=nobind (docs/vllm.md, "
           "'CPU engines sharing a host').")
    log.warning("%s", msg)
    return msg


def _fmt(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))

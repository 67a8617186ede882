"""The daemon's CPU priority (``cpu_nice``), set once at start, before any thread.

On Linux the nice value is a per-thread attribute, inherited by the threads (and
processes) a thread creates: set in the main thread before the daemon makes its ZMQ I/O
threads, NIXL's threads, its copy threads and its posting workers, it covers them all;
threads that already exist (none in `kvd serve`; a host process embedding the daemon may
have some) are set too.

Why (docs/notes/2026-12-07-priority-and-runs.md): on a 2-core host whose other threads
compute (a prefill, a decode, a hog), a nice-0 daemon woken by a pull waits for a CPU
before it reads it. On the daemon alone with four computing spinners, nice -10 cut that
wait's p99 from 36-44 ms to 19-29 ms; spinners that only ``sched_yield`` delay it
either way alike. In whole vLLM engines the gain is not shown.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("kvd.daemon")


@dataclass(frozen=True)
class Priority:
    wanted: int  # cpu_nice; 0: leave the process as started
    nice: int  # in effect afterwards (the main thread's)
    refused: str = ""  # why a raise was not allowed ("" when it was, or not asked)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process as a whole
        return [0]


def apply_nice(wanted: int, *, getpriority: Callable[[int, int], int] = os.getpriority,
               setpriority: Callable[[int, int, int], None] = os.setpriority,
               threads: Callable[[], list[int]] = _threads) -> Priority:
    """Set every thread of this process to nice ``wanted`` (0: nothing is changed). A
    raise the process is not allowed (no CAP_SYS_NICE) leaves the process as it was:
    the daemon works at any priority, only slower on a busy host. Nothing is logged
    here: `log_priority` says it once the daemon serves (a daemon that cannot start
    says only why, on one line)."""
    before = getpriority(os.PRIO_PROCESS, 0)
    if wanted == 0 or wanted == before:
        return Priority(wanted, before)
    try:
        for tid in threads():
            try:
                setpriority(os.PRIO_PROCESS, tid, wanted)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except PermissionError as exc:
        for tid in threads():  # any thread set before the refusal goes back
            try:
                setpriority(os.PRIO_PROCESS, tid, before)
            except OSError:
                pass
        return Priority(wanted, before, refused=str(exc.strerror or exc))
    return Priority(wanted, getpriority(os.PRIO_PROCESS, 0))


def log_priority(p: Priority) -> None:
    """One line on what `apply_nice` did: a warning if the raise was refused."""
    if p.refused:
        log.warning("kvd runs at nice %d, not cpu_nice=%d: %s (raising a priority needs "
                    "CAP_SYS_NICE or RLIMIT_NICE; on a busy host pulls may wait for a "
                    "CPU; set cpu_nice=0 to keep the priority as started)", p.nice,
                    p.wanted, p.refused)
    elif p.wanted:
        log.info("CPU priority: nice %d", p.nice)

"""The daemon's CPU priority (``cpu_nice``), set once at start, before any thread.

On Linux the nice value is a per-thread attribute, inherited by the threads (and
processes) a thread creates: set in the main thread before the daemon makes its ZMQ I/O
threads, NIXL's threads, its copy threads and its posting workers, it covers them all;
threads that already exist (none in `kvd serve`; a host process embedding the daemon may
have some) are set too.

A thread's nice value only weighs it against the threads of its own scheduling group.
Processes in the root CPU cgroup of a kernel with ``sched_autogroup_enabled`` are
grouped by session, and the groups share the CPUs by their own nice value
(``/proc/<pid>/autogroup``): there a daemon started in its own session (``setsid``, as
the bench and the local cluster start it) competes with each engine's session as one
group, whatever its threads' nice. So a daemon that leads its session sets that group's
nice too; one that shares its session with other processes (a shell's) leaves it, as
raising it would raise them. Under systemd or Kubernetes each service or pod is a cgroup
and its CPU weight (``CPUWeight=``, a CPU request) does that part instead.

Why (docs/notes/2026-12-07-priority-and-runs.md, docs/notes/2026-12-07-sched-trace.md):
on a 2-core host whose other threads compute (a prefill, a decode, a hog), a daemon
woken by a pull waits for a CPU before it reads it. On the daemon alone with four
computing spinners in its session, nice -10 cut that wait's p99 from 36-44 ms to
19-29 ms. In whole vLLM engines, each in its own session, the threads' nice did not
show: the daemon's session competed as one group (woken-to-running up to 59 ms).
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
    group: str = ""  # what became of the session's autogroup (`apply_group_nice`)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process as a whole
        return [0]


AUTOGROUP_SWITCH = "/proc/sys/kernel/sched_autogroup_enabled"
AUTOGROUP_SELF = "/proc/self/autogroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def apply_group_nice(wanted: int, *, read: Callable[[str], str | None] = _read,
                     write: Callable[[str, str], None] = _write,
                     leads_session: Callable[[], bool] = lambda: os.getsid(0) == os.getpid(),
                     ) -> str:
    """Set this session's autogroup to nice ``wanted`` where the kernel groups by session
    and this process leads its session (module doc). Returns what it did, for the log:
    "" when autogroups do not apply (off, not Linux, ``wanted`` 0)."""
    if wanted == 0 or (read(AUTOGROUP_SWITCH) or "0").strip() != "1":
        return ""
    current = read(AUTOGROUP_SELF)  # "/autogroup-42 nice 0"
    if current is None:
        return ""
    if not leads_session():
        return ("its session's autogroup, shared with other processes, is left as it is "
                "(start kvd in a session of its own, setsid, for the priority to count "
                "against other sessions)")
    try:
        write(AUTOGROUP_SELF, str(wanted))
    except OSError as exc:  # EPERM/EACCES: no CAP_SYS_NICE for a raise
        return f"its session's autogroup stays as it was ({exc.strerror or exc})"
    return f"its session's autogroup at nice {wanted}"


def apply_nice(wanted: int, *, getpriority: Callable[[int, int], int] = os.getpriority,
               setpriority: Callable[[int, int, int], None] = os.setpriority,
               threads: Callable[[], list[int]] = _threads,
               group_nice: Callable[[int], str] = apply_group_nice) -> Priority:
    """Set every thread of this process to nice ``wanted`` (0: nothing is changed). A
    raise the process is not allowed (no CAP_SYS_NICE) leaves the process as it was:
    the daemon works at any priority, only slower on a busy host. Nothing is logged
    here: `log_priority` says it once the daemon serves (a daemon that cannot start
    says only why, on one line). Where the threads were set, the session's autogroup is
    set too (`apply_group_nice`)."""
    before = getpriority(os.PRIO_PROCESS, 0)
    if wanted == 0:
        return Priority(wanted, before)
    try:
        for tid in (threads() if wanted != before else []):
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
    return Priority(wanted, getpriority(os.PRIO_PROCESS, 0), group=group_nice(wanted))


def log_priority(p: Priority) -> None:
    """One line on what `apply_nice` did: a warning if the raise was refused."""
    if p.refused:
        log.warning("kvd runs at nice %d, not cpu_nice=%d: %s (raising a priority needs "
                    "CAP_SYS_NICE or RLIMIT_NICE; on a busy host pulls may wait for a "
                    "CPU; set cpu_nice=0 to keep the priority as started)", p.nice,
                    p.wanted, p.refused)
    elif p.wanted:
        log.info("CPU priority: nice %d%s", p.nice, f"; {p.group}" if p.group else "")

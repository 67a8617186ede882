"""Timing every KvdConnector hook vLLM calls inside its engine step.

Each call records its wall time, the calling thread's CPU time, the time that thread
waited on the OS run queue (``/proc/thread-self/schedstat``: runnable, but another
process or thread had the core) and the time the garbage collector ran during it.
What is left (wall - cpu - run queue) is time the thread slept: waiting for the GIL
held by another thread of the process, or a blocking call. That splits a slow call
into "kvd did work", "kvd waited on something" and "the OS gave the core away",
which is what the issue asks to show for any call over 1 ms.
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvd.integrations.vllm.connector import KvdConnector

# Every KvdConnector method vLLM calls inside its engine step (scheduler and worker).
STEP_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
              "build_connector_meta", "request_finished", "request_finished_all_groups",
              "bind_connector_metadata", "start_load_kv", "wait_for_save",
              "get_transfer_results", "get_finished", "get_block_ids_with_load_errors",
              "build_connector_worker_meta", "get_kv_connector_stats",
              "update_connector_output")
HOOK_MAX_S = 0.001  # each hook returns within 1 ms whatever the daemon does
SLEPT_MAX_S = 0.002  # a call may wait this long for the GIL another thread holds
# ...except the worker's report in a step that computes nothing while transfers are out:
# it waits for kvd's events, at most kvd_idle_wait_s (KvdWorker.step_wait_s)
WAITING_HOOKS = ("get_transfer_results", "get_finished")


@dataclass(frozen=True)
class Call:
    wall_s: float
    cpu_s: float  # this thread on a core
    runq_s: float  # runnable, waiting for a core (the OS)
    gc_s: float  # the collector ran (part of cpu_s)
    may_wait_s: float = 0.0  # an empty step's report may wait this long for kvd's events

    @property
    def slept_s(self) -> float:
        """Neither running nor runnable: the GIL held by another thread, or a wait (less
        the wait for events an empty step is allowed)."""
        return max(0.0, self.wall_s - self.cpu_s - self.runq_s - self.may_wait_s)


_local = threading.local()


def _sched() -> tuple[int, int]:
    """(ns on a core, ns waiting on the run queue) of the calling thread. CPU time from
    the thread clock (exact now); the run-queue wait from schedstat (brought up to date
    each time the thread is put back on a core, so exact while it runs)."""
    fd = getattr(_local, "fd", None)
    if fd is None:
        fd = _local.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    return time.thread_time_ns(), int(os.pread(fd, 128, 0).split()[1])


@dataclass
class HookTimes:
    calls: dict[str, list[Call]] = field(
        default_factory=lambda: {name: [] for name in STEP_HOOKS})
    gc_total_s: float = 0.0

    def clear(self) -> None:
        for c in self.calls.values():
            c.clear()

    def walls(self) -> dict[str, list[float]]:
        return {n: [c.wall_s for c in cs] for n, cs in self.calls.items()}

    def slow(self, over_s: float = HOOK_MAX_S) -> list[tuple[str, Call]]:
        return sorted(((n, c) for n, cs in self.calls.items() for c in cs
                       if c.wall_s > over_s), key=lambda x: -x[1].wall_s)

    def table(self) -> str:
        """One line per hook called: n, p50, p99, max (ms); then every call over 1 ms
        split into cpu / run queue / slept / gc."""
        lines = [f"{'hook':<32}{'n':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"]
        for name, cs in self.calls.items():
            if not cs:
                continue
            w = sorted(c.wall_s for c in cs)
            lines.append(f"{name:<32}{len(w):>7}{statistics.median(w) * 1e3:>9.3f}"
                         f"{p99(w) * 1e3:>9.3f}{w[-1] * 1e3:>9.3f}")
        slow = self.slow()
        for name, c in slow[:10] + [x for x in slow[10:]
                                    if x[1].cpu_s > HOOK_MAX_S or x[1].slept_s > SLEPT_MAX_S]:
            lines.append(f"  over 1 ms: {name} wall {c.wall_s * 1e3:.2f} = cpu "
                         f"{c.cpu_s * 1e3:.2f} (gc {c.gc_s * 1e3:.2f}) + run queue "
                         f"{c.runq_s * 1e3:.2f} + slept {c.slept_s * 1e3:.2f} ms")
        return "\n".join(lines)


def check_hooks(times: HookTimes, what: str, min_n: int = 100) -> None:
    """Each hook's p99 within HOOK_MAX_S (hooks called at least
    ``min_n`` times; below that a p99 is the max), less the time the OS kept the thread
    waiting for a core (on a quiet host the wall-clock p99 is within it too; with
    several test suites on this 2-core host, a few percent of calls wait 2-10 ms for a
    core, which ``table`` shows). A call over HOOK_MAX_S must owe the
    excess to the host: its own work (CPU less the collector's) within HOOK_MAX_S, and
    asleep (the GIL held by another thread of the process, or a wait) at most
    SLEPT_MAX_S; the rest is the OS run queue. A background thread that the step
    starts, or that keeps the GIL for long, shows up as sleep (a connector that
    started a thread in the step slept 1.6 to 4.7 ms per such call)."""
    for name, calls in times.calls.items():
        if len(calls) >= min_n:
            assert p99([c.wall_s - c.runq_s - c.may_wait_s for c in calls]) <= HOOK_MAX_S, \
                f"{name}: p99 over 1 ms (less the run queue) {what}\n{times.table()}"
    for name, c in times.slow():
        assert c.cpu_s - c.gc_s <= HOOK_MAX_S, \
            f"{name} worked {c.cpu_s * 1e3:.2f} ms {what}\n{times.table()}"
        assert c.slept_s <= SLEPT_MAX_S, \
            f"{name} slept {c.slept_s * 1e3:.2f} ms {what}\n{times.table()}"


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile (the largest value below 100 samples)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]


@pytest.fixture
def hook_times(monkeypatch: pytest.MonkeyPatch) -> Iterator[HookTimes]:
    """Every call of each step hook (the test clears it once set-up is done: engine
    set-up is not a step)."""
    times = HookTimes()

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            _local.gc_start = time.perf_counter()
        elif getattr(_local, "gc_start", None) is not None:
            times.gc_total_s += time.perf_counter() - _local.gc_start
            _local.gc_start = None

    gc.callbacks.append(on_gc)
    for name in STEP_HOOKS:
        real = getattr(KvdConnector, name)

        @functools.wraps(real)
        def timed(self, *args, _real=real, _name=name, **kwargs):
            worker = getattr(self, "_worker", None)
            may_wait_s = (worker.step_wait_s if _name in WAITING_HOOKS and worker is not None
                          else 0.0)
            gc0, (cpu0, rq0) = times.gc_total_s, _sched()
            start = time.perf_counter()
            try:
                return _real(self, *args, **kwargs)
            finally:
                wall = time.perf_counter() - start
                cpu1, rq1 = _sched()
                times.calls[_name].append(Call(wall, (cpu1 - cpu0) / 1e9, (rq1 - rq0) / 1e9,
                                               times.gc_total_s - gc0, may_wait_s))

        monkeypatch.setattr(KvdConnector, name, timed)
    try:
        yield times
    finally:
        gc.callbacks.remove(on_gc)
        fd = getattr(_local, "fd", None)
        if fd is not None:
            os.close(fd)
            _local.fd = None

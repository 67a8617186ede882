"""How late the daemon's event loop runs: the proof that nothing blocks it
(an engine's Ping or Poll has a 50 ms budget).

Every face, pull, lease and heartbeat of a daemon shares one asyncio loop, so one
callback that holds it (a NIXL call inline, a big descriptor build, a registration)
delays every engine's Ping and Poll behind it. A timer that asks to wake after
``interval_s`` and wakes later measures exactly that delay, whatever caused it: the
lateness goes to ``kvd_event_loop_lag_seconds``; the part of it the daemon itself caused
(less the time the kernel kept the loop's thread off a CPU) to
``kvd_event_loop_held_seconds``; and a stall long enough to hurt an engine
(``STALL_LOG_S``) is logged with both.

The lag is read on the daemon's clock, so a fake clock in tests sees none.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

from kvd.daemon.clock import Clock

log = logging.getLogger("kvd.daemon")

LOOP_LAG_INTERVAL_S = 0.01  # 100 wake-ups a second: ~1 ms of CPU per second
STALL_LOG_S = 0.05  # the engine face's Ping/Poll budget
STALL_LOG_EVERY_S = 10.0  # at most one stall line per this long (a stalled host repeats)


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


async def watch_loop_lag(clock: Clock, lag: Observer, held: Observer | None = None,
                         interval_s: float = LOOP_LAG_INTERVAL_S,
                         run_delay_s: Callable[[], float] | None = None) -> None:
    """Forever: sleep ``interval_s``, record how much later than asked the loop woke
    (``lag``), and how much of that something in the daemon held it (``held``).

    Lateness has two causes: a callback that holds the loop (running, or blocked in a
    call), and a kernel that keeps the loop's thread off a CPU (a busy host, a
    throttled pod). The second is the thread's run delay (schedstat: time runnable but
    not running); ``held`` is the lateness less that delay, so that a daemon on a
    starved host is not blamed for its host, nor a held loop excused by one."""
    read_delay, close = (run_delay_s, None) if run_delay_s else _run_delay_reader()
    next_log_s = 0.0
    try:
        delay0_s = read_delay()
        while True:
            asked_s = clock.now() + interval_s
            await clock.sleep(interval_s)
            now, delay1_s = clock.now(), read_delay()
            late_s = max(0.0, now - asked_s)
            held_s = max(0.0, late_s - (delay1_s - delay0_s))
            delay0_s = delay1_s
            lag.observe(late_s)
            if held is not None:
                held.observe(held_s)
            if late_s >= STALL_LOG_S and now >= next_log_s:
                next_log_s = now + STALL_LOG_EVERY_S
                log.warning("event loop stalled %.0f ms, held by the daemon %.0f ms of it "
                            "(the rest waiting for a CPU): engines' Pings and Polls waited as "
                            "long", late_s * 1000, held_s * 1000)
    finally:
        if close is not None:
            close()


def _run_delay_reader() -> tuple[Callable[[], float], Callable[[], None] | None]:
    """(seconds the calling thread has waited for a CPU, so far; closer). Linux only:
    elsewhere the delay reads 0 (every late tick counts as held)."""
    try:
        fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    except OSError:
        return (lambda: 0.0), None

    def read() -> float:
        try:
            return int(os.pread(fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    return read, lambda: os.close(fd)

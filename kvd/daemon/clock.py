"""The one clock of a daemon: every deadline, lease, sleep, timeout and loop cadence.

Injecting one object (rather than ``time.monotonic`` here and ``asyncio.sleep``
there) is what lets a test move a daemon through a 30 s lease or a 60 s transfer
timeout in milliseconds, deterministically: the fake in ``tests/support/clock.py``
implements the same methods on virtual time. Only measurements reported as
metrics (how long a post or handshake took) use ``time.perf_counter`` directly.

Monotonic only: no timestamp is ever exchanged with a peer, so clock skew between
nodes cannot shorten or stretch a lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

T = TypeVar("T")

# Housekeeping looks every 50 ms: a gap longer than this between two of its looks means
# the daemon itself could not run (SIGSTOP, a starved or stuck loop, a VM pause).
STALL_S = 1.0


class StallGap:
    """How long a periodic check of the daemon's own could not run.

    ``step(now_s)`` returns the time since its previous call when that is longer than
    STALL_S (the daemon stalled), else 0.0. Whatever the daemon could not hear meanwhile
    (a consumer's heartbeats, an engine's pings: still queued in its sockets) must not
    count against their senders: leases and engine silence are moved on by the gap."""

    def __init__(self, now_s: float) -> None:
        self._last_s = now_s

    def step(self, now_s: float) -> float:
        last, self._last_s = self._last_s, now_s
        gap_s = now_s - last
        return gap_s if gap_s > STALL_S else 0.0


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        """``aw``'s result, or TimeoutError (``aw`` cancelled) once ``timeout_s`` passed."""
        ...

    def call_later(self, seconds: float, fn: Callable[[], object]) -> Cancellable:
        """Call ``fn`` once ``seconds`` passed, unless cancelled first. Unlike `wait_for`
        it runs nothing in a task of its own: a deadline on the current task (cancel it)
        costs no extra loop turns."""
        ...


class Cancellable(Protocol):
    def cancel(self) -> object: ...


class MonotonicClock:
    """Real time: ``time.monotonic`` and the event loop's own timers."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        return await asyncio.wait_for(aw, timeout_s)

    def call_later(self, seconds: float, fn: Callable[[], object]) -> Cancellable:
        return asyncio.get_running_loop().call_later(seconds, fn)

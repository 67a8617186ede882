"""How late the daemon's event loop runs: the proof that nothing blocks it (issue 20.4).

Every face, pull, lease and heartbeat of a daemon shares one asyncio loop, so one
callback that holds it (a NIXL call inline, a big descriptor build, a registration)
delays every engine's Ping and Poll behind it. A timer that asks to wake after
``interval_s`` and wakes later measures exactly that delay, whatever caused it: the
lateness goes to ``kvd_event_loop_lag_seconds``, and a stall long enough to hurt an
engine (``STALL_LOG_S``) is logged with its length.

The lag is read on the daemon's clock, so a fake clock in tests sees none.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvd.daemon.clock import Clock

log = logging.getLogger("kvd.daemon")

LOOP_LAG_INTERVAL_S = 0.01  # 100 wake-ups a second: ~1 ms of CPU per second
STALL_LOG_S = 0.05  # the engine face's Ping/Poll budget (issue 20.4)
STALL_LOG_EVERY_S = 10.0  # at most one stall line per this long (a stalled host repeats)


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


async def watch_loop_lag(clock: Clock, lag: Observer, interval_s: float = LOOP_LAG_INTERVAL_S
                         ) -> None:
    """Forever: sleep ``interval_s``, record how much later than asked the loop woke."""
    next_log_s = 0.0
    while True:
        asked_s = clock.now() + interval_s
        await clock.sleep(interval_s)
        now = clock.now()
        late_s = max(0.0, now - asked_s)
        lag.observe(late_s)
        if late_s >= STALL_LOG_S and now >= next_log_s:
            next_log_s = now + STALL_LOG_EVERY_S
            log.warning("event loop stalled %.0f ms (a callback held it; engines' Pings and "
                        "Polls waited as long)", late_s * 1000)

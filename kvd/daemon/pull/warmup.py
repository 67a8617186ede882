"""A consumer engine's producers greeted ahead of its first pull (the `WarmUp` request).

Between two daemons the first pull of a pair pays the handshake: the Hello round trip,
loading the producer daemon's NIXL agent, on the same host mapping its pool files, and
planning the pair's assembly (~50 ms on a 2-core host, against 2-4 ms for a warm pull;
docs/notes/2026-11-28-handover-runs.md). An engine that knows its producers (the vLLM
connector's ``kvd_producers``) names them at start-up; the daemon greets each in the
background and keeps trying those not reachable or not registered yet (a prefill engine
that starts later), backing off, for up to WARM_UP_S. Nothing here is on a pull's path:
a pull that comes first greets as before (the handshake is single-flight, so a pull and
a warm-up share one), and a producer never greeted costs only that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvd.daemon.clock import Clock
from kvd.errors import KvdError
from kvd.wire import protocol as P

log = logging.getLogger("kvd.consumer")

WARM_UP_S = 600.0  # how long a producer not reachable or registered yet is retried
# after a dropped connection came back (kvd.daemon.peers.table): its pairs, this long
REGAIN_S = 30.0
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0

# (consumer engine, producer engine, producer daemon address) -> True when warm, False
# when not yet possible (an engine not registered or not complete yet); raises KvdError
# for a refusal worth retrying too (unreachable, not registered there yet).
WarmPair = Callable[[str, str, str], Awaitable[bool]]


async def warm_producers(warm_pair: WarmPair, clock: Clock, engine_id: str,
                         producers: list[P.Producer], horizon_s: float = WARM_UP_S) -> None:
    await asyncio.gather(*(_warm_one(warm_pair, clock, engine_id, p, horizon_s)
                           for p in producers))


async def _warm_one(warm_pair: WarmPair, clock: Clock, engine_id: str,
                    producer: P.Producer, horizon_s: float) -> None:
    deadline_s = clock.now() + horizon_s
    delay_s, why = RETRY_FIRST_S, "not registered yet"
    while True:
        try:
            if await warm_pair(engine_id, producer.engine_id, producer.address):
                log.info("warmed up pulls of %s from %s at %s", engine_id,
                         producer.engine_id, producer.address)
                return
        except KvdError as exc:
            why = str(exc)
        if clock.now() + delay_s > deadline_s:
            log.info("pulls of %s from %s at %s not warmed up in %.0f s (%s): the first "
                     "pull greets", engine_id, producer.engine_id, producer.address,
                     horizon_s, why)
            return
        await clock.sleep(delay_s)
        delay_s = min(delay_s * 2, RETRY_MAX_S)

"""Completion events per engine, delivered by long poll (no busy polling).

A Poll waits until its engine has events or its timeout ends; events are
kept (bounded) until some client of that engine polls them, so an event is
never lost because no poll happened to be waiting. A poll with timeout 0 is
answered at once. Dropped events (an engine that never polls) are counted.

Delivery after a push is scheduled (the daemon passes ``loop.call_soon``), so a
burst of events of one loop iteration (pulls failed together) is one reply.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvd.wire import protocol as P

log = logging.getLogger("kvd.events")

MAX_EVENTS_PER_ENGINE = 100_000
MAX_POLL_WAIT_S = 60.0  # a longer Poll timeout is answered (empty) after this


@dataclass
class Waiter:
    identity: bytes
    msg_id: int
    max_events: int
    deadline_s: float


class EventHub:
    def __init__(self, reply: Callable[[bytes, int, P.Events], None],
                 now: Callable[[], float], on_drop: Callable[[], None] = lambda: None,
                 schedule: Callable[[Callable[[], None]], object] | None = None) -> None:
        self._reply = reply
        self._now = now
        self._on_drop = on_drop
        self._schedule = schedule
        self._due: set[str] = set()  # engines with a delivery scheduled
        self.queues: dict[str, deque[P.Event]] = {}
        self.waiters: dict[str, list[Waiter]] = {}

    def push(self, engine_id: str, event: P.Event) -> None:
        q = self.queues.setdefault(engine_id, deque())
        if len(q) >= MAX_EVENTS_PER_ENGINE:
            lost = q.popleft()
            self._on_drop()
            log.warning("engine %s does not poll its events: dropped the oldest (%s %s)",
                        engine_id, lost.kind, lost.request_id, extra={"engine_id": engine_id})
        q.append(event)
        if self._schedule is None:
            self._deliver(engine_id)
        elif engine_id not in self._due:
            self._due.add(engine_id)
            self._schedule(lambda: self._deliver(engine_id))

    def answer(self, identity: bytes, msg_id: int, event: P.Event) -> None:
        """Reply to the one request that asked for this event (a Pull answered when done),
        at once: it is not queued, so no poll sees it twice."""
        self._reply(identity, msg_id, P.Events(events=[event]))

    def wait(self, engine_id: str, identity: bytes, msg_id: int, timeout_s: float,
             max_events: int) -> None:
        """Answer now if events exist (or the timeout is 0), else when they come or time out.

        ``timeout_s`` and ``max_events`` are validated at the decode boundary (finite,
        bounded); the wait itself is capped at MAX_POLL_WAIT_S.
        """
        timeout_s = min(max(timeout_s, 0.0), MAX_POLL_WAIT_S)
        max_events = min(max(max_events, 1), P.MAX_POLL_EVENTS)
        self.waiters.setdefault(engine_id, []).append(
            Waiter(identity, msg_id, max_events, self._now() + timeout_s))
        self._deliver(engine_id)
        if timeout_s == 0.0:
            self.expire()

    def _deliver(self, engine_id: str) -> None:
        self._due.discard(engine_id)
        q = self.queues.get(engine_id)
        waiters = self.waiters.get(engine_id)
        while q and waiters:
            w = waiters.pop(0)
            batch = [q.popleft() for _ in range(min(w.max_events, len(q)))]
            self._reply(w.identity, w.msg_id, P.Events(events=batch))

    def expire(self) -> None:
        """Answer polls whose timeout ended with an empty list."""
        now = self._now()
        for engine_id, waiters in self.waiters.items():
            keep = []
            for w in waiters:
                if now >= w.deadline_s:
                    self._reply(w.identity, w.msg_id, P.Events(events=[]))
                else:
                    keep.append(w)
            self.waiters[engine_id] = keep
        self.waiters = {k: v for k, v in self.waiters.items() if v}

    def forget_except(self, engine_ids: set[str]) -> None:
        """Drop queued events of engines that no longer exist (nobody can poll them)."""
        for engine_id in [e for e in self.queues if e not in engine_ids]:
            del self.queues[engine_id]

    def flush_all(self) -> None:
        """At stop: answer every waiting poll, with the events still queued for it."""
        for engine_id in list(self.waiters):
            self._deliver(engine_id)
        for waiters in self.waiters.values():
            for w in waiters:
                self._reply(w.identity, w.msg_id, P.Events(events=[]))
        self.waiters.clear()

"""Completion events per engine, delivered by long poll (no busy polling).

A Poll waits until its engine has events or its timeout ends; events are
kept (bounded) until some client of that engine polls them, so an event is
never lost because no poll happened to be waiting. A poll with timeout 0 is
answered at once. Dropped events (an engine that never polls) are counted.

Two delivery modes, chosen per Poll. Plain (``ack`` -1): an event goes to one poll and
is gone, so a reply the client gave up on (it timed out; its thread got no CPU) takes
its events with it. Acknowledged (``ack`` >= 0): every event gets a ``seq``, increasing
per daemon incarnation, and stays queued until a later Poll acknowledges it; a reply
carries every unacknowledged event, so a lost, late, duplicated or reordered reply
loses nothing and the client drops the ``seq`` it has seen (kvd.client.EventCursor).
An engine should use one mode: a plain poll still takes the events it is given.

Delivery after a push is scheduled, so a burst of events of one loop iteration (pulls
failed together) is one reply. The daemon schedules it with `AfterBurst`: when the
engine face has read every request that waits on it (at most BURST_HOLD_S later). A
decode engine's step sends its pulls back to back; each local pull ends inside its
handler, and the face yields the loop every 2 ms, so delivered at the next loop turn
the burst's events went out in pieces (run 6 of docs/notes/2026-11-28-handover-runs.md:
the five events of a step in replies 100 ms apart), each piece a reply to send and a
wake-up of the engine's worker, which on a busy host takes the CPU the daemon needs
for the rest of the burst. Held until the burst is read, they leave in one reply.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvd.ops.trace import TRACE
from kvd.wire import protocol as P

log = logging.getLogger("kvd.events")

MAX_EVENTS_PER_ENGINE = 100_000
MAX_POLL_WAIT_S = 60.0  # a longer Poll timeout is answered (empty) after this
# Events wait for the engine face's burst to be read at most this long (a face that
# never runs dry, e.g. a flood of pings, delays no event more than this).
BURST_HOLD_S = 0.03


class AfterBurst:
    """Runs scheduled callbacks (event deliveries) once nothing waits on the engine face
    (``waiting``: its Inbox's), or ``hold_s`` after the first of them was scheduled;
    never inside the call that schedules. No task, no timer: a check at each loop turn
    while a burst is read (the face yields every SERVE_SLICE_S)."""

    def __init__(self, now: Callable[[], float], hold_s: float = BURST_HOLD_S,
                 call_soon: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.waiting: Callable[[], bool] = lambda: False  # the engine face's, once bound
        self._now = now
        self._hold_s = hold_s
        self._call_soon = call_soon
        self._pending: list[Callable[[], None]] = []
        self._since_s = 0.0
        self.held = 0  # loop turns a delivery waited for the burst (tests)

    def schedule(self, fn: Callable[[], None]) -> None:
        if not self._pending:
            self._since_s = self._now()
            self._soon(self._run)
        self._pending.append(fn)

    def _soon(self, fn: Callable[[], None]) -> None:
        if self._call_soon is not None:
            self._call_soon(fn)
        else:
            asyncio.get_running_loop().call_soon(fn)

    def _run(self) -> None:
        if self._pending and self.waiting() and self._now() - self._since_s < self._hold_s:
            self.held += 1
            self._soon(self._run)
            return
        fns, self._pending = self._pending, []
        for fn in fns:
            fn()


@dataclass
class Waiter:
    identity: bytes
    msg_id: int
    max_events: int
    deadline_s: float
    ack: int = -1  # -1: plain delivery; else the highest seq the client has


class EventHub:
    def __init__(self, reply: Callable[[bytes, int, P.Events], None],
                 now: Callable[[], float], on_drop: Callable[[], None] = lambda: None,
                 schedule: Callable[[Callable[[], None]], object] | None = None,
                 instance_id: str = "") -> None:
        self._reply = reply
        self._now = now
        self._on_drop = on_drop
        self._schedule = schedule
        self.instance_id = instance_id
        self._due: set[str] = set()  # engines with a delivery scheduled
        self._last_seq = 0
        self.queues: dict[str, deque[P.Event]] = {}  # each in seq order
        self.waiters: dict[str, list[Waiter]] = {}

    def push(self, engine_id: str, event: P.Event) -> None:
        self._last_seq += 1
        event = msgspec.structs.replace(event, seq=self._last_seq)
        q = self.queues.setdefault(engine_id, deque())
        if len(q) >= MAX_EVENTS_PER_ENGINE:
            lost = q.popleft()
            self._on_drop()
            log.warning("engine %s does not poll its events: dropped the oldest (%s %s)",
                        engine_id, lost.kind, lost.request_id, extra={"engine_id": engine_id})
        q.append(event)
        if TRACE.on and event.kind == "done_recving":
            TRACE.point("daemon_event", event.request_id)
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
             max_events: int, ack: int = -1, ack_instance: str = "") -> None:
        """Answer now if events exist (or the timeout is 0), else when they come or time out.

        ``timeout_s`` and ``max_events`` are validated at the decode boundary (finite,
        bounded); the wait itself is capped at MAX_POLL_WAIT_S. ``ack`` >= 0: the
        acknowledged mode (module docstring); events up to ``ack`` are dropped first,
        unless ``ack_instance`` names another incarnation (then nothing is acknowledged).
        """
        timeout_s = min(max(timeout_s, 0.0), MAX_POLL_WAIT_S)
        max_events = min(max(max_events, 1), P.MAX_POLL_EVENTS)
        if ack >= 0:
            if ack_instance != self.instance_id:
                ack = 0
            q = self.queues.get(engine_id)
            while q and q[0].seq <= ack:
                q.popleft()
        self.waiters.setdefault(engine_id, []).append(
            Waiter(identity, msg_id, max_events, self._now() + timeout_s, ack))
        self._deliver(engine_id)
        if timeout_s == 0.0:
            self.expire()

    def _deliver(self, engine_id: str) -> None:
        self._due.discard(engine_id)
        q = self.queues.get(engine_id)
        waiters = self.waiters.get(engine_id)
        if not q or not waiters:
            return
        keep = []
        for w in waiters:
            if not q:
                keep.append(w)
            elif w.ack < 0:
                batch = [q.popleft() for _ in range(min(w.max_events, len(q)))]
                self._reply(w.identity, w.msg_id,
                            P.Events(events=[msgspec.structs.replace(e, seq=0)
                                             for e in batch]))
            elif q[-1].seq > w.ack:
                batch = list(itertools.islice((e for e in q if e.seq > w.ack), w.max_events))
                if TRACE.on:
                    for e in batch:
                        if e.kind == "done_recving":
                            TRACE.point("daemon_event_sent", e.request_id)
                self._reply(w.identity, w.msg_id,
                            P.Events(events=batch, instance_id=self.instance_id))
            else:
                keep.append(w)
        self.waiters[engine_id] = keep

    def expire(self) -> None:
        """Answer polls whose timeout ended with an empty list."""
        now = self._now()
        for engine_id, waiters in self.waiters.items():
            keep = []
            for w in waiters:
                if now >= w.deadline_s:
                    self._reply(w.identity, w.msg_id, self._empty(w))
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
                self._reply(w.identity, w.msg_id, self._empty(w))
        self.waiters.clear()

    def _empty(self, w: Waiter) -> P.Events:
        return P.Events(events=[], instance_id=self.instance_id if w.ack >= 0 else "")

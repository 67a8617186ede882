"""Producer side: published requests and their lease state machine.

    HELD --acquire--> READING --all expected notices--> DONE
      |                  |
      +---lease ends-----+--> EXPIRED
      +---engine gone / abandoned / stopped-----------> RELEASED

Every state change is a row of ``TRANSITIONS`` (looked up by `HeldRequest._to`, the
one place that assigns a hold's state; kvd.daemon.transitions.BadTransition for a move
the table does not list), made by a HeldRequest method. Pure: every method takes
``now_s`` from the daemon's injected clock; a peer's timestamps are never used,
so clock skew between nodes cannot shorten or stretch a lease.

Each consumer engine's expected read count is fixed when it acquires (from its
parallelism, sent in the Acquire), together with the incarnation of the daemon
that acquired: a restarted consumer daemon acquiring again starts its count over
(the READs of its previous incarnation died with it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvd.daemon.transitions import step
from kvd.errors import BlockIdError, BusyError, KvdError, NotFoundError


class HeldState(enum.Enum):
    HELD = "held"
    READING = "reading"
    DONE = "done"
    EXPIRED = "expired"
    RELEASED = "released"


TERMINAL = {HeldState.DONE, HeldState.EXPIRED, HeldState.RELEASED}


class HeldOn(enum.Enum):
    """What happened to a hold."""

    ACQUIRE = "acquire"  # a consumer's Acquire (another consumer's: READING again)
    ALL_READ = "all_read"  # every expected consumer's notices are in
    LEASE_ENDS = "lease_ends"
    RELEASE = "release"  # its engine left, every consumer abandoned it, the daemon stops


_H = HeldState
TRANSITIONS: dict[HeldState, dict[HeldOn, HeldState]] = {
    _H.HELD: {HeldOn.ACQUIRE: _H.READING, HeldOn.LEASE_ENDS: _H.EXPIRED,
              HeldOn.RELEASE: _H.RELEASED},
    _H.READING: {HeldOn.ACQUIRE: _H.READING, HeldOn.ALL_READ: _H.DONE,
                 HeldOn.LEASE_ENDS: _H.EXPIRED, HeldOn.RELEASE: _H.RELEASED},
    _H.DONE: {},
    _H.EXPIRED: {},
    _H.RELEASED: {},
}


def next_held_state(state: HeldState, event: HeldOn) -> HeldState:
    """Raises kvd.daemon.transitions.BadTransition for a move the table does not list."""
    return step(TRANSITIONS, state, event, "a hold")


@dataclass
class Reader:
    """One consumer engine reading the request."""

    expected_reads: int
    instance: str  # the consumer daemon incarnation that acquired
    reads: int = 0


@dataclass
class HeldRequest:
    engine_id: str
    request_id: str
    block_ids: frozenset[int]
    lease_s: float
    deadline_s: float
    consumers: int
    published_s: float
    state: HeldState = HeldState.HELD
    readers: dict[str, Reader] = field(default_factory=dict)
    consumers_done: set[str] = field(default_factory=set)
    abandoned: set[str] = field(default_factory=set)
    nbytes: int = 0  # read out of our pools, as reported by the consumers' notices
    hold_id: int = 0  # unique in this daemon incarnation: the publish receipt names it
    # Once a consumer reads, its renewals are never shorter than this (the daemon's
    # lease_s): an engine's shorter lease (Publish.lease_s) bounds the wait for a consumer
    # that never comes, not a READ under way, which heartbeats renew only every
    # heartbeat_interval_s and a consumer stalled under its liveness timeout not at all.
    reading_lease_s: float = 0.0
    traceparent: str = ""  # the Publish's W3C trace context (its span's parent)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def _to(self, event: HeldOn) -> None:
        self.state = next_held_state(self.state, event)

    def acquire(self, consumer_engine: str, block_ids: list[int], now_s: float,
                expected_reads: int = 1, instance: str = "") -> None:
        if self.terminal:
            raise NotFoundError(f"request {self.request_id!r} is no longer held "
                                f"({self.state.value})")
        missing = set(block_ids) - self.block_ids
        if missing:
            raise BlockIdError(f"request {self.request_id!r}: blocks {sorted(missing)[:8]} were "
                               "not published")
        reader = self.readers.get(consumer_engine)
        if reader is None or reader.instance != instance:
            self.readers[consumer_engine] = Reader(expected_reads, instance)
            self.consumers_done.discard(consumer_engine)
        self._to(HeldOn.ACQUIRE)
        self.renew(now_s)

    def renew(self, now_s: float) -> None:
        if not self.terminal:
            lease_s = self.lease_s
            if self.state is HeldState.READING:
                lease_s = max(lease_s, self.reading_lease_s)
            self.deadline_s = max(self.deadline_s, now_s + lease_s)

    def notice(self, consumer_engine: str, reads: int, nbytes: int = 0) -> bool:
        """Count a consumer's finished reads; True once every expected consumer is done.

        A notice from a consumer that never acquired is ignored: it cannot release a hold.
        """
        reader = self.readers.get(consumer_engine)
        if self.terminal or reader is None:
            return False
        self.nbytes += max(nbytes, 0)
        reader.reads += max(reads, 0)
        if reader.reads >= reader.expected_reads:
            self.consumers_done.add(consumer_engine)
        if len(self.consumers_done) >= self.consumers:
            self._to(HeldOn.ALL_READ)
            return True
        return False

    def abandon(self, consumer_engine: str, instance: str = "") -> bool:
        """A consumer gave up (its READs are released); True once no consumer is left.

        An Abandon from another incarnation of the consumer's daemon than the one reading
        now changes nothing: it was sent before that daemon restarted (its READs died with
        it) and came in late, on the dead incarnation's connection, after the new one's
        Acquire; counting it would release the hold under the new one's READ.
        """
        if self.terminal:
            return False
        reader = self.readers.get(consumer_engine)
        if reader is not None and instance and reader.instance and reader.instance != instance:
            return False
        self.abandoned.add(consumer_engine)
        self.consumers_done.add(consumer_engine)
        if len(self.consumers_done) >= self.consumers:
            self._to(HeldOn.RELEASE)
            return True
        return False

    def expired(self, now_s: float) -> bool:
        return not self.terminal and now_s >= self.deadline_s

    def end(self, outcome: str) -> None:
        """Leave the state machine for good: ok (DONE: every read is in, `notice` made it
        so already), expired or released."""
        if self.terminal:
            return
        self._to({"ok": HeldOn.ALL_READ, "expired": HeldOn.LEASE_ENDS}.get(
            outcome, HeldOn.RELEASE))


class HeldTable:
    """All requests this daemon holds, keyed by (engine, request)."""

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self.items: dict[tuple[str, str], HeldRequest] = {}
        self._last_hold_id = 0  # a released hold's id is never given again

    def __len__(self) -> int:
        return len(self.items)

    def publish(self, engine_id: str, request_id: str, block_ids: list[int], lease_s: float,
                consumers: int, now_s: float, hold_id: int = 0,
                reading_lease_s: float = 0.0) -> HeldRequest:
        """``hold_id`` 0: the next counted id; else the engine's own (P.Publish.hold_id).
        ``reading_lease_s``: the shortest lease renewed once a consumer reads."""
        key = (engine_id, request_id)
        if key in self.items:
            raise KvdError(f"request {request_id!r} is already published by engine {engine_id!r}")
        if len(self.items) >= self.max_held:
            raise BusyError(f"{len(self.items)} requests held (max_held_requests)")
        held = HeldRequest(engine_id=engine_id, request_id=request_id,
                           block_ids=frozenset(block_ids), lease_s=lease_s,
                           deadline_s=now_s + lease_s, consumers=consumers, published_s=now_s,
                           hold_id=hold_id or self._last_hold_id + 1,
                           reading_lease_s=reading_lease_s)
        if not hold_id:
            self._last_hold_id += 1
        self.items[key] = held
        return held

    def next_hold_id(self) -> int:
        """A counted hold id, for a hold made outside `publish` (a progressive one)."""
        self._last_hold_id += 1
        return self._last_hold_id

    def get(self, engine_id: str, request_id: str) -> HeldRequest:
        held = self.items.get((engine_id, request_id))
        if held is None:
            raise NotFoundError(f"request {request_id!r} was never published by engine "
                                f"{engine_id!r} or has been released")
        return held

    def pop(self, held: HeldRequest) -> None:
        self.items.pop((held.engine_id, held.request_id), None)

    def expired(self, now_s: float) -> list[HeldRequest]:
        return [h for h in self.items.values() if h.expired(now_s)]

    def postpone(self, delta_s: float) -> None:
        """Move every live lease's deadline on by ``delta_s`` (time the daemon was frozen
        and could not hear the heartbeats that would have renewed it)."""
        for h in self.items.values():
            if not h.terminal:
                h.deadline_s += delta_s

    def of_engine(self, engine_id: str) -> list[HeldRequest]:
        return [h for h in self.items.values() if h.engine_id == engine_id]

"""Producer side: published requests and their lease state machine.

    HELD --acquire--> READING --all expected notices--> DONE
      |                  |
      +---lease ends-----+--> EXPIRED          (engine gone) --> RELEASED

Pure: every method takes ``now_s`` from the daemon's injected monotonic clock;
a peer's timestamps are never used, so clock skew between nodes cannot
shorten or stretch a lease.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvd.errors import BusyError, KvdError, NotFoundError


class HeldState(enum.Enum):
    HELD = "held"
    READING = "reading"
    DONE = "done"
    EXPIRED = "expired"
    RELEASED = "released"


TERMINAL = {HeldState.DONE, HeldState.EXPIRED, HeldState.RELEASED}


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
    reads_by_consumer: dict[str, int] = field(default_factory=dict)
    consumers_done: set[str] = field(default_factory=set)
    abandoned: set[str] = field(default_factory=set)
    nbytes: int = 0  # read out of our pools, as reported by the consumers' notices

    def acquire(self, consumer_engine: str, block_ids: list[int], now_s: float) -> None:
        if self.state in TERMINAL:
            raise NotFoundError(f"request {self.request_id!r} is no longer held "
                                f"({self.state.value})")
        missing = set(block_ids) - self.block_ids
        if missing:
            raise KvdError(f"request {self.request_id!r}: blocks {sorted(missing)[:8]} were not "
                           "published")
        self.state = HeldState.READING
        self.reads_by_consumer.setdefault(consumer_engine, 0)
        self.renew(now_s)

    def renew(self, now_s: float) -> None:
        if self.state not in TERMINAL:
            self.deadline_s = max(self.deadline_s, now_s + self.lease_s)

    def notice(self, consumer_engine: str, reads: int, expected_reads: int,
               nbytes: int = 0) -> bool:
        """Count a consumer's finished reads; True once every expected consumer is done."""
        if self.state in TERMINAL:
            return False
        self.nbytes += max(nbytes, 0)
        got = self.reads_by_consumer.get(consumer_engine, 0) + reads
        self.reads_by_consumer[consumer_engine] = got
        if got >= expected_reads:
            self.consumers_done.add(consumer_engine)
        if len(self.consumers_done) >= self.consumers:
            self.state = HeldState.DONE
            return True
        return False

    def abandon(self, consumer_engine: str) -> bool:
        """A consumer gave up (its READs are released); True once no consumer is left."""
        if self.state in TERMINAL:
            return False
        self.abandoned.add(consumer_engine)
        self.consumers_done.add(consumer_engine)
        if len(self.consumers_done) >= self.consumers:
            self.state = HeldState.RELEASED
            return True
        return False

    def expired(self, now_s: float) -> bool:
        return self.state not in TERMINAL and now_s >= self.deadline_s


class HeldTable:
    """All requests this daemon holds, keyed by (engine, request)."""

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self.items: dict[tuple[str, str], HeldRequest] = {}

    def __len__(self) -> int:
        return len(self.items)

    def publish(self, engine_id: str, request_id: str, block_ids: list[int], lease_s: float,
                consumers: int, now_s: float) -> HeldRequest:
        key = (engine_id, request_id)
        if key in self.items:
            raise KvdError(f"request {request_id!r} is already published by engine {engine_id!r}")
        if len(self.items) >= self.max_held:
            raise BusyError(f"{len(self.items)} requests held (max_held_requests)")
        held = HeldRequest(engine_id=engine_id, request_id=request_id,
                           block_ids=frozenset(block_ids), lease_s=lease_s,
                           deadline_s=now_s + lease_s, consumers=consumers, published_s=now_s)
        self.items[key] = held
        return held

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

    def of_engine(self, engine_id: str) -> list[HeldRequest]:
        return [h for h in self.items.values() if h.engine_id == engine_id]

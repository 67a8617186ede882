"""Producer side: progressive holds, sealed a range at a time (pure, sans-IO).

A producer engine that publishes as it computes sends ``Seal``s instead of one
``Publish``: each names every block of the request final so far. The first opens an
`OpenHold`; consumers' daemons ``Watch`` it and read each sealed range as an ordinary
hold of its own (a *range hold*, made when their Acquire names it, see
kvd.wire.protocol.range_request_id), so reading a range is an ordinary pull.

    OPEN --seal--> OPEN --seal(complete)--> COMPLETE --every consumer done--> DONE
      |  --unseal (a higher generation)--> OPEN      |
      +---abort / lease ends / engine gone / every consumer abandoned--+--> ENDED

A higher generation (the engine preempted the request: its blocks were freed or
moved) drops the range holds of the earlier one: what a consumer read of it is read
again, never mixed (the consumer reports only a whole generation that was complete).
Every move is a row of ``TRANSITIONS`` (kvd.daemon.transitions). Time only comes in
as ``now_s``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from kvd.daemon.transitions import step
from kvd.errors import BusyError, ProtocolError

MAX_ENDED_KEPT = 4096  # ended holds remembered, so a late Watch hears why at once


class OpenState(enum.Enum):
    OPEN = "open"
    COMPLETE = "complete"
    DONE = "done"
    ENDED = "ended"


class OpenOn(enum.Enum):
    SEAL = "seal"  # more blocks final, or a new generation
    COMPLETE = "complete"  # the last seal
    ALL_DONE = "all_done"  # every consumer read the complete generation
    END = "end"  # aborted, expired, engine gone, abandoned, daemon stops


_O = OpenState
TRANSITIONS: dict[OpenState, dict[OpenOn, OpenState]] = {
    _O.OPEN: {OpenOn.SEAL: _O.OPEN, OpenOn.COMPLETE: _O.COMPLETE, OpenOn.END: _O.ENDED},
    _O.COMPLETE: {OpenOn.ALL_DONE: _O.DONE, OpenOn.END: _O.ENDED},
    _O.DONE: {},
    _O.ENDED: {},
}
TERMINAL = {OpenState.DONE, OpenState.ENDED}


@dataclass
class OpenHold:
    engine_id: str
    request_id: str
    consumers: int
    lease_s: float
    deadline_s: float
    opened_s: float
    hold_id: int
    block_size_tokens: int
    state: OpenState = OpenState.OPEN
    generation: int = 0
    block_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] | None = None
    num_tokens: int = 0
    # (tokens final, when) of this generation, increasing: when a range became final
    sealed_at: list[tuple[int, float]] = field(default_factory=list)
    consumers_done: set[str] = field(default_factory=set)
    abandoned: set[str] = field(default_factory=set)
    ranges: set[str] = field(default_factory=set)  # range hold request ids, this generation
    nbytes: int = 0  # read out of our pools by its ranges' consumers
    changes: int = 0  # bumps at every change a Watch may be waiting for
    reason: str = ""  # why it ended

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def _to(self, event: OpenOn) -> None:
        self.state = step(TRANSITIONS, self.state, event, "a progressive hold")
        self.changes += 1

    def seal(self, block_ids: list[int], group_block_ids: list[list[int]] | None,
             num_tokens: int, generation: int, complete: bool, now_s: float) -> list[str]:
        """Take a Seal; returns the range holds it drops (a new generation's unseal)."""
        if self.terminal:
            raise ProtocolError(f"request {self.request_id!r} is no longer held "
                                f"({self.state.value}): sealed again")
        if num_tokens > len(block_ids) * self.block_size_tokens:
            raise ProtocolError(f"seal of {num_tokens} tokens in {len(block_ids)} blocks of "
                                f"{self.block_size_tokens}")
        dropped: list[str] = []
        if generation < self.generation:
            raise ProtocolError(f"seal of generation {generation} after {self.generation}")
        if self.state is OpenState.COMPLETE:
            if generation != self.generation or block_ids != self.block_ids:
                raise ProtocolError(f"request {self.request_id!r} was sealed complete: its "
                                    "blocks cannot change any more")
            return dropped
        if generation > self.generation:
            dropped = sorted(self.ranges)
            self.ranges.clear()
            self.generation, self.sealed_at = generation, []
        elif num_tokens < self.num_tokens or (
                block_ids[:len(self.block_ids)] != self.block_ids
                and not (complete and group_block_ids is not None
                         and self.group_block_ids is None)):
            # A hybrid model's complete seal is the first to name its groups (the Mamba
            # state with them), in vLLM's group order: its flat list need not extend the
            # progress seals before it, whose blocks no consumer reads (a hybrid
            # consumer reads every group once complete, kvd.daemon.pull.progressive).
            raise ProtocolError(f"a seal of generation {generation} must extend the last one "
                                "(a changed block needs a new generation)")
        self.block_ids, self.group_block_ids = list(block_ids), group_block_ids
        if num_tokens > self.num_tokens or not self.sealed_at:
            self.sealed_at.append((num_tokens, now_s))
        self.num_tokens = num_tokens
        self.renew(now_s)
        self._to(OpenOn.COMPLETE if complete else OpenOn.SEAL)
        return dropped

    def sealed_since(self, tokens: int) -> float | None:
        """When tokens [0, tokens) were all final in this generation (None: not yet)."""
        for n, at in self.sealed_at:
            if n >= tokens:
                return at
        return None

    def renew(self, now_s: float) -> None:
        if not self.terminal:
            self.deadline_s = max(self.deadline_s, now_s + self.lease_s)

    def done(self, consumer_engine: str, generation: int) -> bool:
        """A consumer read the complete ``generation``; True once every consumer is done."""
        if self.state is not OpenState.COMPLETE or generation != self.generation:
            return False
        self.consumers_done.add(consumer_engine)
        if len(self.consumers_done) >= self.consumers:
            self._to(OpenOn.ALL_DONE)
            return True
        return False

    def abandon(self, consumer_engine: str) -> bool:
        """A consumer gave up; True once no consumer is left (the hold then ends)."""
        if self.terminal:
            return False
        self.abandoned.add(consumer_engine)
        self.consumers_done.add(consumer_engine)
        self.changes += 1
        return len(self.consumers_done) >= self.consumers

    def end(self, reason: str) -> None:
        if not self.terminal:
            self.reason = reason
            self._to(OpenOn.END)


class OpenTable:
    """Every progressive hold of this daemon, and the recently ended ones' reasons."""

    def __init__(self, max_held: int) -> None:
        self.max_held = max_held
        self.items: dict[tuple[str, str], OpenHold] = {}
        self.ended: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self.items)

    def open(self, hold: OpenHold) -> OpenHold:
        if len(self.items) >= self.max_held:
            raise BusyError(f"{len(self.items)} progressive requests held (max_held_requests)")
        key = (hold.engine_id, hold.request_id)
        self.ended.pop(key, None)
        self.items[key] = hold
        return hold

    def close(self, hold: OpenHold) -> None:
        key = (hold.engine_id, hold.request_id)
        if self.items.get(key) is hold:
            del self.items[key]
        self.remember(key, hold.reason or hold.state.value)

    def remember(self, key: tuple[str, str], reason: str) -> None:
        self.ended[key] = reason
        self.ended.move_to_end(key)
        while len(self.ended) > MAX_ENDED_KEPT:
            self.ended.popitem(last=False)

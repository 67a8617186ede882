"""Prefill side of a progressive pull: seal each chunk's blocks as they become final.

A prefill request the router also sent to a decode engine (``kvd_progressive`` with a
``kvd_transfer_id``) is published range by range: after each chunk of chunked prefill
its whole blocks are sealed under the router's transfer id, so the decode's daemon reads
them while the next chunk is computed. A chunk's KV is final once its forward ran: with
async scheduling the step before this one may still run, so what was computed before the
previous step is sealed instead. A preemption frees the request's blocks: what was
sealed is void (a new generation, sealed from nothing). The request's end seals it
complete, or aborts the seal.

Hybrid models (vLLM's KV-cache groups): each chunk's seal names the blocks of the first
full-attention group (none without one), so that the decode's daemon sees the prefill
progress; the complete seal names every group, the Mamba state's one slot with them
(``publish_groups``, as a sequential publish does): a Mamba state is final only once
the request ends, and the decode's daemon reads every group then, in one pull.

Runs inside the engine's scheduler step (``KvdScheduler.build_meta``): nothing here waits
on the daemon. The Seals go out through ``send`` without their replies; a refusal is
logged when ``KvdScheduler`` takes the replies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.client import Messages, engine_hold_id
from kvd.integrations.connector_core.hybrid import publish_groups
from kvd.integrations.connector_core.params import ParamsError, progressive_transfer_id
from kvd.integrations.connector_core.steplog import step_log
from kvd.ops.trace import TRACE
from kvd.wire import protocol as P

FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class Sealing:
    """A prefill request sealed as its chunks are computed (a progressive publish)."""

    transfer_id: str  # the router's id, which the decode side pulls under
    blocks: list[int] = field(default_factory=list)  # the request's blocks, in token order
    generation: int = 0  # bumped at each preemption: its blocks were freed
    sealed: int = 0  # tokens sealed in this generation
    # tokens computed before each step of this generation (num_computed_tokens as each
    # step was scheduled), the latest last
    computed: list[int] = field(default_factory=list)


class Sealer:
    """The sealing prefill requests of one engine, keyed by vLLM's request id.

    ``has_peer()``: the workers told the scheduler its daemon's peer address (nothing is
    sealed before). ``send(msg, request_id)``: hand a Seal to the daemon without waiting;
    False when the daemon takes no messages. ``groups``: a hybrid model's (kvd layer
    kind, block size in tokens) of each KV-cache group, in vLLM's order; None for one
    attention group.
    """

    def __init__(self, engine_id: str, block_size_tokens: int, lease_s: float,
                 consumers: int, has_peer: Callable[[], bool],
                 send: Callable[[P.Seal, str], bool], async_scheduling: bool = False,
                 groups: list[tuple[str, int]] | None = None) -> None:
        self.engine_id = engine_id
        self.block_size_tokens = block_size_tokens
        self.lease_s = lease_s
        self.consumers = consumers
        self._has_peer = has_peer
        self._send = send
        self._lag = 1 if async_scheduling else 0
        self._groups = groups
        # the group whose blocks the chunks' seals name, and its block size (None: only
        # the complete seal is sent)
        self._group: int | None = 0
        if groups is not None:
            attention = [i for i, (kind, _) in enumerate(groups) if kind == "attention"]
            self._group = attention[0] if attention else None
            if attention:
                self.block_size_tokens = groups[attention[0]][1]
        self._sealing: dict[str, Sealing] = {}

    def __bool__(self) -> bool:
        return bool(self._sealing)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._sealing

    def get(self, request_id: str) -> Sealing | None:
        return self._sealing.get(request_id)

    def begin(self, request: Any) -> None:
        """A prefill request the router also sent to a decode engine: seal its chunks."""
        try:
            tid = progressive_transfer_id(request.kv_transfer_params)
        except ParamsError as exc:
            step_log.warning("request %s: bad kvd_transfer_id (%s); publishing once finished",
                             request.request_id, exc)
            return
        if tid is None or request.request_id in self._sealing:
            return
        self._sealing[request.request_id] = Sealing(tid)

    def track(self, output: Any) -> None:
        """Each step: the sealing requests' blocks and computed tokens (vLLM's scheduler
        output); seal what is final. Never waits: the Seals go out without their replies."""
        preempted = getattr(output, "preempted_req_ids", None) or set()
        for rid in preempted:
            s = self._sealing.get(rid)
            if s is not None:
                self._unseal(rid, s)
        for new in getattr(output, "scheduled_new_reqs", ()):
            s = self._sealing.get(new.req_id)
            if s is not None:
                s.blocks = self._blocks(new.block_ids)
                s.computed.append(new.num_computed_tokens)
        cached = getattr(output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", set()) or set()
            for i, rid in enumerate(cached.req_ids):
                s = self._sealing.get(rid)
                if s is None:
                    continue
                ids = cached.new_block_ids[i]
                if rid in resumed:
                    if s.sealed or s.computed and rid not in preempted:
                        self._unseal(rid, s)
                    s.blocks = self._blocks(ids)
                elif ids:
                    s.blocks.extend(self._blocks(ids))
                s.computed.append(cached.num_computed_tokens[i])
        bs = self.block_size_tokens
        for rid, s in self._sealing.items():
            if len(s.computed) <= self._lag or self._group is None:
                continue
            final = s.computed[-1 - self._lag] // bs * bs
            del s.computed[:-1 - self._lag]
            if final > s.sealed and final // bs <= len(s.blocks):
                self._seal(rid, s, s.blocks[:final // bs], final, complete=False)

    def _blocks(self, block_ids: Any) -> list[int]:
        """The sealed group's blocks of vLLM's per-group block lists."""
        if not block_ids or self._group is None:
            return []
        return list(block_ids[self._group])

    def finish(self, request: Any, block_ids: list[int],
               group_block_ids: tuple[list[int], ...] | None = None) -> str | None:
        """The request ended (vLLM's ``request_finished``): seal it complete under a hold
        id of the engine's; its transfer id when sealed (the blocks wait for the
        consumer's done_sending), else None (aborted, or the seal was not sent).
        A hybrid model's ``group_block_ids``: one list per group (vLLM's
        ``request_finished_all_groups``)."""
        s = self._sealing.pop(request.request_id)
        if request.status.name not in FINISHED_OK or (self._groups is not None
                                                      and group_block_ids is None):
            if self._has_peer():
                self._send(Messages.seal(self.engine_id, s.transfer_id, [], 0, abort=True),
                           request.request_id)
            return None
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        blocks: Any
        if self._groups is not None and group_block_ids is not None:
            kinds, sizes = zip(*self._groups, strict=True)
            blocks = publish_groups(kinds, group_block_ids, num_tokens, sizes)
        else:
            blocks = list(block_ids[:-(-num_tokens // self.block_size_tokens)])
        if not self._seal(request.request_id, s, blocks, num_tokens, complete=True,
                          hold_id=engine_hold_id()):
            return None
        return s.transfer_id

    def _unseal(self, rid: str, s: Sealing) -> None:
        """Preempted: its blocks were freed; what was sealed is void."""
        s.generation += 1
        s.sealed, s.computed = 0, []
        s.blocks = []
        self._seal(rid, s, [], 0, complete=False)

    def _seal(self, rid: str, s: Sealing, blocks: Any, num_tokens: int,
              complete: bool, hold_id: int = 0) -> bool:
        if not self._has_peer():
            return False
        msg = Messages.seal(self.engine_id, s.transfer_id, blocks, num_tokens,
                            generation=s.generation, complete=complete,
                            lease_s=self.lease_s, consumers=self.consumers,
                            hold_id=hold_id)
        if not self._send(msg, rid):
            step_log.warning("request %s: kvd is not taking messages; seal not sent", rid)
            return False
        s.sealed = num_tokens
        TRACE.point("seal_sent", rid)
        return True

"""Producer side: publish, acquire, heartbeats, READ notices and lease expiry.

A held request pins the pools of every rank of its engine hosted here, from
publish until it ends (all expected notices, lease expiry, or release because
its engine left before anyone acquired it). Expected notices per consumer
engine come from the planner's consumer counts for the ranks hosted here, so a
consumer can neither release early nor be waited for forever: the lease bounds
every hold.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvd import protocol as P
from kvd.daemon.engines import Engine, geometry, parallelism
from kvd.daemon.held import HeldRequest, HeldState, HeldTable
from kvd.errors import KvdError, NotFoundError, ProtocolError
from kvd.planner import plan_transfer

if TYPE_CHECKING:
    from kvd.daemon.server import Daemon

log = logging.getLogger("kvd.producer")

_END_REASONS = {
    "ok": "",
    "expired": "lease expired before every consumer read the request",
    "cancelled": "released without a complete read (a consumer abandoned it, its engine left, "
                 "or the daemon stopped)",
}


class Producer:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.held = HeldTable(daemon.cfg.max_held_requests)
        self.consumers: dict[str, P.EngineDesc] = {}  # consumer engines met at handshake
        self._pinned: dict[tuple[str, str], list] = {}
        self._reading: set[tuple[str, str]] = set()  # acquired, notices still due

    @property
    def reading(self) -> bool:
        """Some consumer is reading from us now: the progress loop must poll often."""
        return bool(self._reading)

    def publish(self, msg: P.Publish) -> None:
        cfg = self.d.cfg
        engine = self.d.engines.get(msg.engine_id)
        if len(msg.block_ids) > cfg.max_blocks_per_request:
            raise KvdError(f"{len(msg.block_ids)} blocks exceed max_blocks_per_request")
        bad = [b for b in msg.block_ids if not 0 <= b < engine.layout.num_blocks]
        if bad:
            raise KvdError(f"block ids {bad[:8]} out of range [0, {engine.layout.num_blocks})")
        if msg.consumers < 1 or msg.consumers > 1024:
            raise KvdError(f"consumers must be 1..1024, got {msg.consumers}")
        lease_s = cfg.lease_s if msg.lease_s is None else msg.lease_s
        if not 0 < lease_s <= 3600:
            raise KvdError(f"lease_s must be in (0, 3600], got {lease_s}")
        if not msg.request_id or len(msg.request_id) > 256:
            raise KvdError("request_id must be 1..256 characters")
        held = self.held.publish(msg.engine_id, msg.request_id, list(msg.block_ids), lease_s,
                                 msg.consumers, self.d.clock())
        ranks = engine.live_ranks()
        for r in ranks:
            r.pins += 1
        self._pinned[(held.engine_id, held.request_id)] = ranks
        self.d.metrics.held_requests.set(len(self.held))

    def acquire(self, msg: P.Acquire) -> P.Acquired:
        held = self.held.get(msg.producer_engine_id, msg.request_id)
        held.acquire(msg.consumer_engine_id, msg.block_ids, self.d.clock())
        self._reading.add((held.engine_id, held.request_id))
        return P.Acquired(epoch=self.d.engines.engines[msg.producer_engine_id].epoch)

    def abandon(self, msg: P.Abandon) -> P.Ok:
        held = self.held.get(msg.producer_engine_id, msg.request_id)
        if held.abandon(msg.consumer_engine_id):
            self.finish(held, "cancelled")
        return P.Ok()

    def heartbeat(self, msg: P.Heartbeat) -> P.HeartbeatAck:
        now, unknown = self.d.clock(), []
        for rid in msg.request_ids[:4096]:
            try:
                self.held.get(msg.producer_engine_id, rid).renew(now)
            except NotFoundError:
                unknown.append(rid)
        return P.HeartbeatAck(unknown=unknown)

    def on_notification(self, agent: str, raw: bytes) -> None:
        try:
            notice = P.decode_notice(raw)
        except ProtocolError as exc:
            self.d.metrics.protocol_error("peer", "decode")
            log.warning("bad notification from %s: %s", agent, exc, extra={"peer": agent})
            return
        try:
            held = self.held.get(notice.producer_engine_id, notice.request_id)
            engine = self.d.engines.engines.get(notice.producer_engine_id)
            consumer = self.consumers.get(notice.consumer_engine_id)
            if engine is None or consumer is None:
                raise NotFoundError(f"unknown engine in notice {notice}")
        except NotFoundError as exc:
            log.warning("notice for a request not held (expired or never published): %s", exc,
                        extra={"request_id": notice.request_id, "peer": agent})
            return
        expected = self.expected_reads(engine, consumer)
        if held.notice(notice.consumer_engine_id, notice.reads, expected, notice.nbytes):
            self.finish(held, "ok")

    def expected_reads(self, engine: Engine, consumer: P.EngineDesc) -> int:
        """Reads the planner sends to the producer ranks hosted on this daemon."""
        plan = plan_transfer(
            geometry(engine.model), engine.par,
            parallelism(consumer.tp_size, consumer.pp_size, consumer.layer_partition))
        return sum(plan.consumers.get(rank, 0)
                   for rank in self.d.engines.rank_ids(engine.engine_id))

    def finish(self, held: HeldRequest, outcome: str) -> None:
        """End a hold exactly once: unpin, emit done_sending, count."""
        if held.state not in (HeldState.DONE, HeldState.EXPIRED, HeldState.RELEASED):
            held.state = HeldState.EXPIRED if outcome == "expired" else HeldState.RELEASED
        self.held.pop(held)
        self._reading.discard((held.engine_id, held.request_id))
        for r in self._pinned.pop((held.engine_id, held.request_id), []):
            r.pins -= 1
        m = self.d.metrics
        m.held_requests.set(len(self.held))
        duration_s = self.d.clock() - held.published_s
        m.transfer_finished("producer", outcome, held.nbytes, duration_s)
        if outcome == "expired":
            m.leases_expired.inc()
            log.warning("lease expired before every consumer read the request",
                        extra={"request_id": held.request_id, "engine_id": held.engine_id})
        self.d.events.push(held.engine_id, P.Event(
            kind="done_sending", request_id=held.request_id, ok=outcome == "ok",
            error=_END_REASONS.get(outcome, outcome),
            nbytes=held.nbytes if outcome == "ok" else 0, duration_s=duration_s))

    def expire(self, now_s: float) -> None:
        for held in self.held.expired(now_s):
            self.finish(held, "expired")

    def engine_gone(self, engine_id: str) -> None:
        """Held requests nobody has acquired are released now; acquired ones run to the end."""
        for held in self.held.of_engine(engine_id):
            if held.state is HeldState.HELD:
                self.finish(held, "cancelled")

    def status(self) -> list[dict]:
        now = self.d.clock()
        return [{"engine_id": h.engine_id, "request_id": h.request_id, "state": h.state.value,
                 "blocks": len(h.block_ids), "lease_remaining_s": round(h.deadline_s - now, 3),
                 "consumers_done": len(h.consumers_done), "consumers": h.consumers}
                for h in self.held.items.values()]

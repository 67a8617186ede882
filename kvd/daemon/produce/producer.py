"""Producer side: hello, publish, acquire, heartbeats, READ notices, progress, lease expiry.

A held request pins the pools of every rank of its engine hosted here, from
publish until it ends (all expected notices, lease expiry, or release because
its engine left before anyone acquired it). Expected notices per consumer
engine come from the planner's consumer counts for the ranks hosted here and
the consumer's parallelism (sent in its Acquire), so a consumer can neither
release early nor be waited for forever: the lease bounds every hold.

The progress loop lives here too: it drives NIXL so that consumers' READs, and
the notices riding on them, complete.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections import OrderedDict
from typing import Any

from kvd.daemon import hybrid
from kvd.daemon.clock import StallGap
from kvd.daemon.engines.table import Engine, PlanCache, check_block_ids
from kvd.daemon.produce.held import HeldRequest, HeldState, HeldTable
from kvd.daemon.produce.opened import OpenHold, OpenState, OpenTable
from kvd.daemon.services import Services
from kvd.errors import (
    BusyError,
    IncompatibleError,
    KvdError,
    LayoutError,
    NotFoundError,
    ProtocolError,
    TooLargeError,
)
from kvd.planner import Parallelism, check_parallelism
from kvd.pool.geometry import geometry, parallelism
from kvd.transport.samehost.discovery import host_facts, same_host_token
from kvd.wire import protocol as P

log = logging.getLogger("kvd.producer")

_END_REASONS = {
    "ok": "",
    "expired": "lease expired before every consumer read the request",
    "cancelled": "released without a complete read (a consumer abandoned it, its engine left, "
                 "or the daemon stopped)",
}

# Progress polling: every FAST_POLL_S for HOT_WINDOW_S after activity (a READ is likely
# landing), then backing off x2 to READING_POLL_MAX_S while some acquired request is
# being read, or IDLE_POLL_MAX_S when none is (an idle daemon costs ~1% of a core).
FAST_POLL_S = 0.001
HOT_WINDOW_S = 0.005
READING_POLL_MAX_S = 0.002
IDLE_POLL_MAX_S = 0.05


# An Acquire for a request not (yet) published here waits this long for its Publish: an
# engine that sends its Publish without waiting (vLLM's connector) may be overtaken by
# the consumer's Acquire when this daemon was frozen or slow (the two come in on
# different sockets, in either order). At most a quarter of handshake_timeout_s, so the
# consumer (same setting, as a rule) hears "not found" before its Acquire times out.
ACQUIRE_WAITS_FOR_PUBLISH_S = 1.0
# (engine, consumer parallelism) pairs whose expected reads are kept; cleared past it
MAX_EXPECTED_KEPT = 256
MAX_EARLY_ABANDONS = 4096  # requests abandoned before their first Seal, remembered


def _resolve(fut: asyncio.Future[bool], woke: bool) -> None:
    if not fut.done():
        fut.set_result(woke)


class Producer:
    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.held = HeldTable(svc.cfg.max_held_requests)
        self._pinned: dict[tuple[str, str], list] = {}
        self._reading: set[tuple[str, str]] = set()  # acquired, notices still due
        self._expected: dict[tuple[Any, ...], tuple[Engine, int, int]] = {}
        self._plans = PlanCache()
        self._waker: asyncio.Future[bool] | None = None  # the progress loop's pause
        # Acquires waiting for their Publish (ACQUIRE_WAITS_FOR_PUBLISH_S), by request.
        self._unpublished: dict[tuple[str, str], list[tuple[str, asyncio.Future[bool]]]] = {}
        self._stall = StallGap(svc.clock.now())  # housekeeping's looks at the leases
        # Progressive holds (kvd.daemon.produce.opened), their range holds (range request
        # key -> the progressive hold's key), and the Watches waiting for a change.
        self.opened = OpenTable(svc.cfg.max_held_requests)
        self._ranges: dict[tuple[str, str], tuple[str, str]] = {}
        self._watchers: dict[tuple[str, str], list[asyncio.Future[bool]]] = {}
        # Consumers that gave up a request before its first Seal (a progressive pull that
        # timed out): its hold starts without them, so it does not wait a lease for them.
        self._early_abandons: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
        svc.registry.on_engine_gone(self.engine_gone)

    @property
    def reading(self) -> bool:
        """Some consumer is reading from us now: the progress loop must poll often."""
        return bool(self._reading)

    def wake(self) -> None:
        """READ notices may come soon (publish, acquire): poll now."""
        if self._waker is not None:
            _resolve(self._waker, True)

    # ------------------------------------------------------------ engine face

    def publish(self, msg: P.Publish) -> P.Published:
        cfg = self.svc.cfg
        engine = self.svc.registry.get(msg.engine_id)
        if len(msg.block_ids) > cfg.max_blocks_per_request:
            raise TooLargeError(f"{len(msg.block_ids)} blocks exceed max_blocks_per_request "
                                f"({cfg.max_blocks_per_request})")
        check_block_ids(msg.block_ids, engine.layout.num_blocks, "published")
        hybrid.check_group_ids(engine.model, msg.block_ids, msg.group_block_ids, "publish")
        if 0 < msg.hold_id < P.ENGINE_HOLD_ID_MIN:
            raise ProtocolError(f"hold_id {msg.hold_id} is below {P.ENGINE_HOLD_ID_MIN}: an "
                           "engine's own hold ids must not collide with the daemon's")
        if (msg.engine_id, msg.request_id) in self.opened.items:
            raise KvdError(f"request {msg.request_id!r} is already sealed progressively by "
                           f"engine {msg.engine_id!r}")
        lease_s = cfg.lease_s if msg.lease_s is None else msg.lease_s
        held = self.held.publish(msg.engine_id, msg.request_id, list(msg.block_ids), lease_s,
                                 msg.consumers, self.svc.clock.now(), hold_id=msg.hold_id,
                                 reading_lease_s=cfg.lease_s)
        held.traceparent = msg.traceparent
        ranks = engine.live_ranks()
        for r in ranks:
            r.pins += 1
        self._pinned[(held.engine_id, held.request_id)] = ranks
        self.svc.metrics.held_requests.set(len(self.held))
        self.wake()
        for _, fut in self._unpublished.pop((held.engine_id, held.request_id), ()):
            _resolve(fut, True)
        return P.Published(receipt=P.receipt(self.svc.instance_id, held.hold_id))

    # ------------------------------------------------------------ peer face

    async def hello(self, msg: P.Hello) -> P.HelloReply:
        if msg.consumer.layout.kv_layout == P.AUTO_KV_LAYOUT:
            raise LayoutError("the consumer engine's kv_layout must be concrete: 'auto' is "
                              "resolved by its own daemon at registration, never sent")
        engine = self.svc.registry.get(msg.remote_engine_id)
        if msg.compat_hash != engine.compat:
            raise IncompatibleError(
                f"engine {engine.engine_id!r} here is incompatible with consumer "
                f"{msg.consumer.engine_id!r}: model/dtype/layout differ "
                f"({engine.model} {engine.layout} vs {msg.consumer.model} {msg.consumer.layout})")
        dp = self.svc.datapath
        desc = engine.desc()
        return P.HelloReply(daemon_id=self.svc.daemon_id, agent_name=dp.agent_name,
                            agent_metadata=await dp.metadata(), engine=desc,
                            engine_daemons=list(engine.engine_daemons),
                            host_token=self._host_token,
                            pool_files=[pool_file(r.pool) for r in engine.live_ranks()])

    @functools.cached_property
    def _host_token(self) -> str:
        """This daemon's host, IPC namespace and pool directory, for a consumer daemon to
        tell whether it can map our pool files (kvd.transport.samehost.discovery)."""
        try:
            return same_host_token(host_facts(self.svc.cfg.shm_dir))
        except ValueError:  # an absurdly long pool directory path: no same-host pulls
            return ""

    def acquire_must_wait(self, msg: P.Acquire) -> bool:
        """Whether an Acquire arrived before its Publish (the engine is registered here,
        the request unknown): the peer face then answers it later, never holding every
        other peer message (heartbeats, notices, other Acquires) while it waits.
        An Acquire of a sealed range (progressive) makes that range's hold first."""
        if P.parse_range_request_id(msg.request_id) is not None:
            self._hold_range(msg)
            return False
        return ((msg.producer_engine_id, msg.request_id) not in self.held.items
                and msg.producer_engine_id in self.svc.registry.engines)

    async def acquire_when_published(self, msg: P.Acquire, consumer_instance: str
                                     ) -> P.Acquired:
        """``acquire``, after waiting up to ACQUIRE_WAITS_FOR_PUBLISH_S for a Publish that
        has not come yet. An Abandon from the same consumer meanwhile (it gave up the pull)
        ends the wait with a refusal: answered out of order, the Acquire must not take a
        hold that its consumer has already let go."""
        key = (msg.producer_engine_id, msg.request_id)
        if self.acquire_must_wait(msg):
            fut = asyncio.get_running_loop().create_future()
            waiting = self._unpublished.setdefault(key, [])
            entry = (msg.consumer_engine_id, fut)
            waiting.append(entry)
            try:
                await self.svc.clock.wait_for(fut, min(
                    ACQUIRE_WAITS_FOR_PUBLISH_S, self.svc.cfg.handshake_timeout_s / 4))
            except TimeoutError:
                pass  # acquire() refuses it: never published, or released already
            finally:
                if entry in waiting:
                    waiting.remove(entry)
                if not waiting:
                    self._unpublished.pop(key, None)
            if fut.done() and not fut.cancelled() and fut.result() is False:
                raise NotFoundError(f"request {msg.request_id!r}: its consumer "
                                    f"{msg.consumer_engine_id!r} abandoned it before it "
                                    "was published")
        return self.acquire(msg, consumer_instance)

    def acquire(self, msg: P.Acquire, consumer_instance: str) -> P.Acquired:
        held = self.held.get(msg.producer_engine_id, msg.request_id)
        engine = self.svc.registry.engines.get(msg.producer_engine_id)
        if engine is None:
            raise NotFoundError(f"engine {msg.producer_engine_id!r} is not registered here")
        expected = self._expected_reads(engine, msg)
        if any(r.gone for r in self._pinned.get((held.engine_id, held.request_id), ())):
            # Its blocks are in the pools of the registration that published it (kept while
            # pinned), not in those the engine registered since: a consumer that greeted the
            # new registration would read the request's block ids there.
            raise NotFoundError(f"request {msg.request_id!r}: engine {engine.engine_id!r} "
                                "left after publishing it; its blocks are not in the pools "
                                "registered now")
        now = self.svc.clock.now()
        held.acquire(msg.consumer_engine_id, msg.block_ids, now, expected, consumer_instance)
        if consumer_instance != self.svc.instance_id:
            # a consumer elsewhere: its READs need this side's NIXL progress (and an
            # older peer notifies through NIXL). A local pull's copy needs neither and its
            # notice comes in-process: nothing to poll for.
            self._reading.add((held.engine_id, held.request_id))
            self.wake()
        return P.Acquired(epoch=engine.epoch, held_s=max(0.0, now - held.published_s),
                          hold_id=held.hold_id)

    def abandon(self, msg: P.Abandon, consumer_instance: str = "") -> P.Ok:
        opened = self.opened.items.get((msg.producer_engine_id, msg.request_id))
        if opened is not None:
            if opened.abandon(msg.consumer_engine_id):
                self._end_open(opened, "cancelled", "every consumer abandoned it")
            self._changed(opened)
            return P.Ok()
        key = (msg.producer_engine_id, msg.request_id)
        if key not in self.held.items and msg.producer_engine_id in self.svc.registry.engines:
            self._early_abandons.setdefault(key, set()).add(msg.consumer_engine_id)
            self._early_abandons.move_to_end(key)
            while len(self._early_abandons) > MAX_EARLY_ABANDONS:
                self._early_abandons.popitem(last=False)
        for consumer, fut in self._unpublished.get((msg.producer_engine_id, msg.request_id),
                                                   ()):
            if consumer == msg.consumer_engine_id:
                _resolve(fut, False)  # its Acquire, still waiting, is refused
        held = self.held.get(msg.producer_engine_id, msg.request_id)
        if held.abandon(msg.consumer_engine_id, consumer_instance):
            self.finish(held, "cancelled")
        return P.Ok()

    def heartbeat(self, msg: P.Heartbeat) -> P.HeartbeatAck:
        now, unknown = self.svc.clock.now(), []
        for rid in msg.request_ids:
            try:
                self.held.get(msg.producer_engine_id, rid).renew(now)
            except NotFoundError:
                unknown.append(rid)
        return P.HeartbeatAck(unknown=unknown)

    def _expected_reads(self, engine: Engine, msg: P.Acquire) -> int:
        """`expected_reads` for an Acquire's consumer parallelism (checked), kept per
        (engine, consumer parallelism) while the engine and its epoch stay the same:
        every Acquire asks."""
        key = (engine.engine_id, msg.consumer_tp_size, msg.consumer_pp_size,
               tuple(msg.consumer_layer_partition or ()))
        hit = self._expected.get(key)
        if hit is not None and hit[0] is engine and hit[1] == engine.epoch:
            return hit[2]
        cpar = parallelism(msg.consumer_tp_size, msg.consumer_pp_size,
                           msg.consumer_layer_partition)
        check_parallelism(geometry(engine.model), cpar, "consumer")
        expected = self.expected_reads(engine, cpar)
        if len(self._expected) >= MAX_EXPECTED_KEPT:
            self._expected.clear()
        self._expected[key] = (engine, engine.epoch, expected)
        return expected

    def expected_reads(self, engine: Engine, consumer: Parallelism) -> int:
        """Reads the planner sends to the producer ranks hosted on this daemon."""
        if engine.model.hybrid is not None:
            return hybrid.expected_reads(engine.model, engine.par, consumer,
                                         self.svc.registry.rank_ids(engine.engine_id))
        plan, _ = self._plans.get(geometry(engine.model), engine.par, consumer)
        return sum(plan.consumers.get(rank, 0)
                   for rank in self.svc.registry.rank_ids(engine.engine_id))

    # ------------------------------------------------------------ notices and progress

    def on_notification(self, agent: str, raw: bytes) -> None:
        if not raw:  # a READ posted without a notification (some transports report one)
            return
        try:
            notice = P.decode_notice(raw)
        except ProtocolError as exc:
            self.svc.metrics.protocol_error("peer", exc.reason)
            self.svc.metrics.notifications_failed.inc()
            log.warning("bad notification from %s: %s", agent, exc, extra={"peer": agent})
            return
        self.on_notice(notice, agent)

    def on_notice(self, notice: P.ReadNotice, sender: str) -> None:
        """A consumer's READs from here are done: by NIXL notification or peer request."""
        agent = sender
        try:
            held = self.held.get(notice.producer_engine_id, notice.request_id)
        except NotFoundError as exc:
            log.warning("notice for a request not held (expired or never published): %s", exc,
                        extra={"request_id": notice.request_id, "peer": agent})
            return
        if held.notice(notice.consumer_engine_id, notice.reads, notice.nbytes):
            self.finish(held, "ok")

    async def run_progress(self) -> None:
        """Drive NIXL: collect READ notices, polling fast after activity, then backing off."""
        clock = self.svc.clock
        interval_s, last_activity_s = FAST_POLL_S, clock.now()
        while True:
            try:
                notices = await self.svc.datapath.notifications()
                for agent, raw in notices:
                    self.on_notification(agent, raw)
            except Exception:  # noqa: BLE001 - one bad poll must not stop progress
                log.exception("notification poll failed")
                notices = []
            now_s = clock.now()
            if notices:
                last_activity_s = now_s
            if now_s - last_activity_s < HOT_WINDOW_S:
                interval_s = FAST_POLL_S
            else:
                cap_s = READING_POLL_MAX_S if self.reading else IDLE_POLL_MAX_S
                interval_s = min(interval_s * 2, cap_s)
            # A pause that wake() ends early: a future and a timer, no task per turn.
            self._waker = waker = asyncio.get_running_loop().create_future()
            timer = clock.call_later(interval_s, functools.partial(_resolve, waker, False))
            try:
                woke = await waker
            finally:
                timer.cancel()
            if woke:
                interval_s, last_activity_s = FAST_POLL_S, clock.now()

    # ------------------------------------------------------------ endings

    def finish(self, held: HeldRequest, outcome: str) -> None:
        """End a hold exactly once: unpin, emit done_sending, count."""
        key = (held.engine_id, held.request_id)
        if self.held.items.get(key) is not held:
            return
        held.end(outcome)
        self.held.pop(held)
        self._reading.discard(key)
        for r in self._pinned.pop(key, []):
            r.pins -= 1
        parent = self._ranges.pop(key, None)
        if parent is not None:  # a range of a progressive hold: that hold reports, once
            opened = self.opened.items.get(parent)
            if opened is not None:
                opened.ranges.discard(held.request_id)
                opened.nbytes += held.nbytes
                opened.renew(self.svc.clock.now())  # a lease from here for its done
            self.svc.metrics.held_requests.set(len(self.held))
            return
        m = self.svc.metrics
        if self.svc.spans is not None:
            self.svc.spans.hold_ended(held, outcome, self.svc.clock.now())
        m.held_requests.set(len(self.held))
        duration_s = self.svc.clock.now() - held.published_s
        local = bool(held.readers) and all(r.instance == self.svc.instance_id
                                           for r in held.readers.values())
        m.transfer_finished("producer", outcome, held.nbytes, duration_s,
                            "local" if local else "remote")
        if outcome == "expired":
            m.leases_expired.inc()
            log.warning("lease expired before every consumer read the request",
                        extra={"request_id": held.request_id, "engine_id": held.engine_id})
        self.svc.events.push(held.engine_id, P.Event(
            kind="done_sending", request_id=held.request_id, ok=outcome == "ok",
            error=_END_REASONS.get(outcome, outcome),
            nbytes=held.nbytes if outcome == "ok" else 0, duration_s=duration_s))

    def expire(self, now_s: float) -> None:
        """End the holds whose lease ran out, not counting time this daemon was frozen.

        Housekeeping calls this every 50 ms. A longer gap means the daemon itself was
        stopped (SIGSTOP, a stalled host, a stuck loop): the consumers' heartbeats sent
        meanwhile still wait in its socket, and a consumer's READ may still be running
        against these blocks. Expiring now would hand them back to the engine under
        that READ (a write after hand-back); the leases are moved on by the gap instead.
        """
        stalled_s = self._stall.step(now_s)
        if stalled_s:
            self.held.postpone(stalled_s)
            log.warning("daemon was stalled %.1fs: leases extended by as much", stalled_s)
        for held in self.held.expired(now_s):
            self.finish(held, "expired")
        if stalled_s:
            for opened in self.opened.items.values():
                opened.deadline_s += stalled_s
        # Not while a range of it is held: a READ of it may run, its reader renewing that
        # range's own lease; ending this one would hand the blocks back under the READ.
        for opened in [o for o in self.opened.items.values()
                       if now_s >= o.deadline_s and not o.ranges]:
            self._end_open(opened, "expired", "lease expired before every consumer read it")

    def engine_gone(self, engine_id: str) -> None:
        """Held requests nobody has acquired are released now; acquired ones run to the end."""
        for held in self.held.of_engine(engine_id):
            if held.state is HeldState.HELD and held.request_id not in self._range_ids:
                self.finish(held, "cancelled")
        for opened in [o for o in self.opened.items.values() if o.engine_id == engine_id]:
            if opened.state is OpenState.OPEN:  # never complete: consumers recompute
                self._end_open(opened, "cancelled", "its engine left before sealing it all")

    def cancel_all(self) -> None:
        for opened in list(self.opened.items.values()):
            self._end_open(opened, "cancelled", "the daemon stopped")
        for held in list(self.held.items.values()):
            self.finish(held, "cancelled")

    def status(self) -> list[P.HeldStatus]:
        now = self.svc.clock.now()
        return [P.HeldStatus(engine_id=h.engine_id, request_id=h.request_id, state=h.state.value,
                             blocks=len(h.block_ids),
                             lease_remaining_s=round(h.deadline_s - now, 3),
                             consumers_done=len(h.consumers_done), consumers=h.consumers)
                for h in self.held.items.values() if h.request_id not in self._range_ids
                ] + [P.HeldStatus(engine_id=o.engine_id, request_id=o.request_id,
                                  state=o.state.value, blocks=len(o.block_ids),
                                  lease_remaining_s=round(o.deadline_s - now, 3),
                                  consumers_done=len(o.consumers_done), consumers=o.consumers)
                     for o in self.opened.items.values()]

    # ------------------------------------------------------------ progressive holds

    @property
    def _range_ids(self) -> set[str]:
        return {k[1] for k in self._ranges}

    def seal(self, msg: P.Seal) -> P.Published:
        """A producer engine's Seal: open the progressive hold, extend it, unseal it (a
        new generation) or abort it; every Watch waiting on it hears at once."""
        cfg = self.svc.cfg
        engine = self.svc.registry.get(msg.engine_id)
        key = (msg.engine_id, msg.request_id)
        if len(msg.block_ids) > cfg.max_blocks_per_request:
            raise TooLargeError(f"{len(msg.block_ids)} blocks exceed max_blocks_per_request "
                                f"({cfg.max_blocks_per_request})")
        if len(msg.request_id) > P.MAX_PROGRESSIVE_ID_CHARS:
            raise ProtocolError(f"a progressive request id is at most "
                                f"{P.MAX_PROGRESSIVE_ID_CHARS} characters")
        check_block_ids(msg.block_ids, engine.layout.num_blocks, "sealed")
        if msg.group_block_ids is not None:
            hybrid.check_group_ids(engine.model, msg.block_ids, msg.group_block_ids, "seal")
        if 0 < msg.hold_id < P.ENGINE_HOLD_ID_MIN:
            raise ProtocolError(f"hold_id {msg.hold_id} is below {P.ENGINE_HOLD_ID_MIN}")
        if key in self.held.items:
            raise KvdError(f"request {msg.request_id!r} is already published by engine "
                           f"{msg.engine_id!r}")
        now = self.svc.clock.now()
        opened = self.opened.items.get(key)
        if msg.abort:
            if opened is not None:
                self._end_open(opened, "cancelled", "aborted by its engine")
            else:
                self.opened.remember(key, "aborted by its engine")
                self._wake_watchers(key)
            return P.Published()
        if opened is None and key in self.opened.ended:
            # Ended already (every consumer gave up, its lease ran out): no new hold for
            # nobody. Its complete Seal (the one the engine frees its blocks after) gets
            # done_sending now, not after a lease.
            if msg.complete:
                self.svc.events.push(msg.engine_id, P.Event(
                    kind="done_sending", request_id=msg.request_id, ok=False,
                    error=f"the request's hold ended already ({self.opened.ended[key]})"))
            return P.Published()
        if opened is None:
            lease_s = cfg.lease_s if msg.lease_s is None else msg.lease_s
            if len(self.held) + len(self.opened) >= cfg.max_held_requests:
                raise BusyError(f"{len(self.held) + len(self.opened)} requests held "
                                "(max_held_requests)")
            opened = self.opened.open(OpenHold(
                engine_id=msg.engine_id, request_id=msg.request_id, consumers=msg.consumers,
                lease_s=lease_s, deadline_s=now + lease_s, opened_s=now,
                hold_id=msg.hold_id or self.held.next_hold_id(),
                block_size_tokens=engine.layout.block_size_tokens, generation=msg.generation))
            ranks = engine.live_ranks()
            for r in ranks:
                r.pins += 1
            self._pinned[key] = ranks
            gone = self._early_abandons.pop(key, set())
            if gone and any(opened.abandon(c) for c in sorted(gone)):
                self._end_open(opened, "cancelled", "every consumer gave up before the first "
                               "seal")
                return P.Published(receipt=P.receipt(self.svc.instance_id, opened.hold_id))
        for rid in opened.seal(list(msg.block_ids), msg.group_block_ids, msg.num_tokens,
                               msg.generation, msg.complete, now):
            held = self.held.items.get((msg.engine_id, rid))
            if held is not None:
                self.finish(held, "cancelled")
        self._changed(opened)
        return P.Published(receipt=P.receipt(self.svc.instance_id, opened.hold_id))

    def _hold_range(self, msg: P.Acquire) -> None:
        """The hold of one sealed range, for the one consumer whose Acquire names it:
        made at its first Acquire, from the progressive hold's current generation."""
        key = (msg.producer_engine_id, msg.request_id)
        if key in self.held.items:
            return
        parsed = P.parse_range_request_id(msg.request_id)
        assert parsed is not None
        base, generation, _start, end = parsed
        parent = (msg.producer_engine_id, base)
        opened = self.opened.items.get(parent)
        if opened is None or opened.terminal:
            why = self.opened.ended.get(parent, "never sealed")
            raise NotFoundError(f"request {base!r} is not held progressively here ({why})")
        if generation != opened.generation:
            raise NotFoundError(f"request {base!r}: generation {generation} was unsealed "
                                f"(now {opened.generation}): read it again")
        if any(r.gone for r in self._pinned.get(parent, ())):
            # As in `acquire`: its blocks are in the pools of the registration that sealed
            # them (kept while pinned), not in those the engine registered since, which a
            # consumer greeting the engine again would read.
            raise NotFoundError(f"request {base!r}: engine {msg.producer_engine_id!r} left "
                                "after sealing it; its blocks are not in the pools "
                                "registered now")
        sealed_s = opened.sealed_since(end)
        if sealed_s is None and opened.state is not OpenState.COMPLETE:
            raise NotFoundError(f"request {base!r}: tokens up to {end} are not sealed")
        engine = self.svc.registry.get(msg.producer_engine_id)
        held = self.held.publish(msg.producer_engine_id, msg.request_id,
                                 list(opened.block_ids), self.svc.cfg.lease_s, 1,
                                 self.svc.clock.now(), reading_lease_s=self.svc.cfg.lease_s)
        # the range's blocks were final since its seal, which the consumer heard of
        # before it sent this Acquire: a READ posted meanwhile cannot predate them
        held.published_s = sealed_s if sealed_s is not None else opened.sealed_at[-1][1]
        ranks = engine.live_ranks()
        for r in ranks:
            r.pins += 1
        self._pinned[key] = ranks
        self._ranges[key] = parent
        opened.ranges.add(msg.request_id)
        opened.renew(self.svc.clock.now())
        self.svc.metrics.held_requests.set(len(self.held))

    def _end_open(self, opened: OpenHold, outcome: str, reason: str) -> None:
        """End a progressive hold once: its ranges, its pins, one done_sending."""
        key = (opened.engine_id, opened.request_id)
        if self.opened.items.get(key) is not opened:
            return
        if outcome == "ok":
            assert opened.state is OpenState.DONE
        else:
            opened.end(reason)
        for rid in sorted(opened.ranges):
            held = self.held.items.get((opened.engine_id, rid))
            if held is not None:
                self.finish(held, "cancelled")
        self.opened.close(opened)
        for r in self._pinned.pop(key, []):
            r.pins -= 1
        self._wake_watchers(key)
        nbytes = opened.nbytes
        duration_s = self.svc.clock.now() - opened.opened_s
        self.svc.metrics.transfer_finished("producer", outcome, nbytes, duration_s, "remote")
        self.svc.events.push(opened.engine_id, P.Event(
            kind="done_sending", request_id=opened.request_id, ok=outcome == "ok",
            error="" if outcome == "ok" else reason,
            nbytes=nbytes if outcome == "ok" else 0, duration_s=duration_s))

    def _changed(self, opened: OpenHold) -> None:
        if opened.state is OpenState.DONE:
            self._end_open(opened, "ok" if not opened.abandoned else "cancelled", "")
        self._wake_watchers((opened.engine_id, opened.request_id))

    def _wake_watchers(self, key: tuple[str, str]) -> None:
        for fut in self._watchers.pop(key, ()):
            _resolve(fut, True)

    def _sealed(self, key: tuple[str, str]) -> P.Sealed:
        opened = self.opened.items.get(key)
        if opened is None:
            ended = self.opened.ended.get(key)
            if ended is None:
                return P.Sealed(state="waiting", num_tokens=-1)
            return P.Sealed(state="ended", error=ended)
        if opened.terminal:
            return P.Sealed(state="ended", error=opened.reason or opened.state.value)
        return P.Sealed(state="complete" if opened.state is OpenState.COMPLETE else "open",
                        generation=opened.generation, num_tokens=opened.num_tokens,
                        block_ids=list(opened.block_ids),
                        group_block_ids=opened.group_block_ids,
                        block_size_tokens=opened.block_size_tokens)

    async def watch(self, msg: P.Watch) -> P.Sealed:
        """A consumer daemon's Watch: answered at the first change past what it saw, or
        after ``wait_s``. ``done`` counts that consumer as done first."""
        key = (msg.producer_engine_id, msg.request_id)
        if key not in self.opened.items and key not in self.opened.ended:
            self.svc.registry.get(msg.producer_engine_id)  # an unknown engine: refused now
        opened = self.opened.items.get(key)
        if opened is not None:
            opened.renew(self.svc.clock.now())
            if msg.done:
                opened.done(msg.consumer_engine_id, msg.generation)
                self._changed(opened)
                return self._sealed(key) if not opened.terminal else P.Sealed(
                    state="complete" if opened.state is OpenState.DONE else "ended",
                    generation=opened.generation, num_tokens=opened.num_tokens,
                    error=opened.reason)
        deadline_s = self.svc.clock.now() + msg.wait_s
        while True:
            now = self._sealed(key)
            if (now.state == "ended" or now.generation != msg.generation
                    or now.num_tokens != msg.num_tokens
                    or (now.state == "complete") != msg.complete):
                return now
            left_s = deadline_s - self.svc.clock.now()
            if left_s <= 0:
                return now
            fut = asyncio.get_running_loop().create_future()
            self._watchers.setdefault(key, []).append(fut)
            try:
                await self.svc.clock.wait_for(fut, left_s)
            except TimeoutError:
                pass
            finally:
                waiting = self._watchers.get(key)
                if waiting is not None and fut in waiting:
                    waiting.remove(fut)
                    if not waiting:
                        del self._watchers[key]


def pool_file(pool: object) -> P.PoolFile:
    """A pool's file, for a consumer daemon on this host to map: its path and identity;
    none (an empty path) for a memfd pool (no path another process may open) or a VRAM
    pool."""
    directory, name = getattr(pool, "directory", None), getattr(pool, "name", None)
    if directory is None or not name or getattr(pool, "fd", None) is not None:
        return P.PoolFile()
    path = os.path.join(str(directory), str(name))
    try:
        st = os.stat(path)
    except OSError:
        return P.PoolFile()
    return P.PoolFile(path=path, dev=st.st_dev, ino=st.st_ino)

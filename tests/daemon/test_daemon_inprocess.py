"""Two in-process daemons over LoopbackTransport, on the shared fake clock.

Every lease, timeout and loop cadence of the daemons runs on virtual time: the
tests move through leases and heartbeat periods in milliseconds, and nothing
depends on how fast the machine is. Also a loopback pull checked byte for byte,
and an injected READ failure that reports every local block invalid.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from support.clock import FakeClock
from support.inprocess import (
    MODEL,
    SHAPE,
    config,
    daemon_pair,
    register,
    run,
    sample,
    wait_event,
)

from kvd.client import AsyncKvdClient
from kvd.daemon.pull.driver import PullDriver
from kvd.daemon.server import Daemon
from kvd.planner import RankId
from kvd.pool.shm import kvd_segments
from kvd.tools.sim import EngineShape, check_shard, global_kv, write_shard
from kvd.transport.loopback import LoopbackTransport
from kvd.wire import protocol as P


def test_lease_expires_on_the_injected_clock() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [0, 1])  # lease 5 s (config default)
            await p.clock.run(4.9)
            assert [h.request_id for h in (await p.pc.status()).held] == ["r1"]
            await p.clock.run(0.2)
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert not sent.ok and sent.error.startswith("lease expired")
            assert (await p.pc.status()).held == []
            assert sample(p.prefill, "kvd_leases_expired_total") == 1
            assert sample(p.prefill, "kvd_held_requests") == 0
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [0, 1], [2, 3])
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert not recv.ok and recv.invalid_block_ids == [2, 3]
            assert "never published" in recv.error

    run(body())


def test_acquire_renews_the_lease_by_the_daemon_clock() -> None:
    """A peer's Acquire moves the deadline to now + lease on the producer's own clock."""
    async def body() -> None:
        async with daemon_pair() as p:
            await register(p.pc, "pre")
            await p.pc.publish("pre", "r1", [0])
            await p.clock.run(4.0)
            p.prefill.producer.acquire(P.Acquire(request_id="r1", producer_engine_id="pre",
                                                 consumer_engine_id="dec", block_ids=[0]), "")
            await p.clock.run(4.0)  # 8 s after publish, 4 s after the acquire
            held = (await p.pc.status()).held
            assert [h.state for h in held] == ["reading"]
            assert held[0].lease_remaining_s == pytest.approx(1.0, abs=0.02)
            await p.clock.run(1.1)
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert not sent.ok

    run(body())


def test_loopback_pull_is_byte_exact_and_releases_the_producer() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 64)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [3, 5, 7, 9])
            await p.pc.publish("pre", "r1", [3, 5, 7, 9])
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [3, 5, 7, 9],
                            [0, 1, 2, 4])
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert recv.ok, recv.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [0, 1, 2, 4]) == 0
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert sent.ok and sent.nbytes == recv.nbytes > 0

    run(body())


@pytest.mark.parametrize("producer_takes_requests", [True, False])
def test_read_notice_reaches_the_producer_as_request_or_notification(
        producer_takes_requests: bool) -> None:
    """The ReadNotice goes as a peer request; a producer that refuses that kind (an
    earlier v2) gets it as a NIXL notification. Either way the hold ends ``ok``."""
    async def body() -> None:
        async with daemon_pair() as p:
            if not producer_takes_requests:
                p.prefill.peer_face.allowed = tuple(
                    c for c in P.PEER_REQUESTS if c is not P.ReadNotice)
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [3, 5])
            await p.pc.publish("pre", "r1", [3, 5])
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [3, 5], [0, 1])
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert recv.ok, recv.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [0, 1]) == 0
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert sent.ok and sent.nbytes == recv.nbytes > 0
            refused = sample(p.prefill, "kvd_protocol_errors_total", face="peer",
                             reason="unknown")
            assert refused == (0 if producer_takes_requests else 1)

    run(body())


def test_two_prefill_engines_publishing_the_same_id_are_pulled_apart() -> None:
    """Pull.remote_request_id: one decode engine pulls the same producer id from two
    prefill engines under two local ids; events carry the local ids, bytes are each
    engine's own."""
    async def body() -> None:
        async with daemon_pair() as p:
            pa = await register(p.pc, "pre-a")
            pb = await register(p.pc, "pre-b")
            dr = await register(p.dc, "dec")
            ga, gb = global_kv(MODEL, 32, seed=1), global_kv(MODEL, 32, seed=2)
            write_shard(pa.kv, ga, MODEL, SHAPE, 0, 0, [1, 2])
            write_shard(pb.kv, gb, MODEL, SHAPE, 0, 0, [1, 2])
            await p.pc.publish("pre-a", "same", [1, 2])
            await p.pc.publish("pre-b", "same", [1, 2])
            addr = p.prefill.cfg.peer_address
            await p.dc.pull("dec", "from-a", "pre-a", addr, [1, 2], [3, 4],
                            remote_request_id="same")
            await p.dc.pull("dec", "from-b", "pre-b", addr, [1, 2], [5, 6],
                            remote_request_id="same")
            for rid in ("from-a", "from-b"):
                ev = await wait_event(p.dc, p.clock, "dec", rid, "done_recving")
                assert ev.ok and ev.request_id == rid, ev.error
            assert check_shard(dr.kv, ga, MODEL, SHAPE, 0, 0, [3, 4]) == 0
            assert check_shard(dr.kv, gb, MODEL, SHAPE, 0, 0, [5, 6]) == 0
            for eng in ("pre-a", "pre-b"):
                sent = await wait_event(p.pc, p.clock, eng, "same", "done_sending")
                assert sent.ok, sent.error

    run(body())


def test_injected_read_failure_invalidates_every_local_block() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            # With the receipt, as the connector sends it: a READ posted before the
            # Acquire's reply cannot predate the publish, so it is never read again
            # (without it, a slow host re-read and the second READ was ok: CI 14:04)
            receipt = await p.pc.publish("pre", "r1", [0, 1])
            p.decode.datapath.transport.fail_next_reads = 1
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [0, 1], [6, 7],
                            publish_receipt=receipt)
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert not recv.ok and recv.invalid_block_ids == [6, 7]
            assert recv.error.startswith("transfer_failed")  # the producer is still there
            assert (await p.dc.status()).pulls == []
            assert p.decode.datapath.transport.counts().transfers == 0, "READ not released"
            # No notice came, but the consumer abandoned after releasing its READs: the
            # producer frees the blocks at once, without waiting for the lease.
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending", fake_s=1.0)
            assert not sent.ok and "abandoned" in sent.error
            assert (await p.pc.status()).held == []

    run(body())


async def _until_state(client: AsyncKvdClient, clock: FakeClock, what: str, want: str) -> None:
    async def reached() -> bool:
        st = await client.status()
        rows = st.pulls if what == "pulls" else st.held
        return [r.state for r in rows] == [want]

    await clock.until(reached, timeout_s=5.0, what=f"{what} {want}")


def test_heartbeats_keep_a_slow_pull_alive_past_its_lease() -> None:
    """The consumer renews the lease while its READ runs; the producer never expires it."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5) as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
            await p.pc.publish("pre", "r1", [1, 2])  # lease 5 s of fake time
            p.decode.datapath.transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await _until_state(p.dc, p.clock, "pulls", "reading")
            for _ in range(5):  # 20 s of fake time: four leases
                await p.clock.run(4.0, step_s=0.05)
                assert [h.state for h in (await p.pc.status()).held] == ["reading"], \
                    "the lease expired although the consumer kept heartbeating"
            p.decode.datapath.transport.hold_reads = False
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert recv.ok, recv.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert sent.ok
            assert sample(p.prefill, "kvd_leases_expired_total") == 0

    run(body())


def test_a_read_again_keeps_the_lease_alive_while_the_first_read_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A READ posted before the Acquire's reply, whose hold then looks younger than the
    READ, is read again once the first one ends; heartbeats must cover that wait (a big
    READ can outlast a lease; it expired here before the fix)."""
    from kvd.daemon.pull import acquiring, machine

    rereads: list[str] = []

    def predate(msg: object, daemons: object, replies: object, agent: str,
                posted_s: float) -> bool:
        rereads.append(agent)
        return len(rereads) == 1  # the first READ only

    # the READ goes out before the reply, and its hold looks too young once
    monkeypatch.setattr(acquiring.Acquiring, "answered", property(lambda self: False))
    monkeypatch.setattr(machine, "may_predate_publish", predate)

    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5) as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
            await p.pc.publish("pre", "r1", [1, 2])  # lease 5 s of fake time
            p.decode.datapath.transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await _until_state(p.dc, p.clock, "pulls", "discarding")
            for _ in range(5):  # 20 s of fake time: four leases
                await p.clock.run(4.0, step_s=0.05)
                assert [h.state for h in (await p.pc.status()).held] == ["reading"], \
                    "the lease expired while the first READ was ending"
            assert rereads, "the read-again path was not taken"
            p.decode.datapath.transport.hold_reads = False
            recv = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert recv.ok, recv.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert sent.ok
            assert sample(p.prefill, "kvd_leases_expired_total") == 0

    run(body())


def test_lease_expires_when_the_reading_consumer_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No heartbeats (consumer daemon stopped mid-read): the producer's lease ends the hold."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [1, 2])

            async def silent(*_: object) -> None:  # a consumer that went away says nothing
                return None

            monkeypatch.setattr(PullDriver, "_beat", silent)
            monkeypatch.setattr(PullDriver, "_abandon", silent)
            p.decode.datapath.transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await _until_state(p.pc, p.clock, "held", "reading")
            await p.clock.run(4.5)
            assert [h.state for h in (await p.pc.status()).held] == ["reading"]
            await p.clock.run(1.0)
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert not sent.ok and sent.error.startswith("lease expired")
            assert sample(p.prefill, "kvd_leases_expired_total") == 1

    run(body(), )


def test_async_client_pings_and_hears_a_lost_registration() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            lost: list[str] = []
            client = AsyncKvdClient(p.prefill.cfg.engine_address, timeout_s=5,
                                    ping_interval_s=0.05, on_lost=lost.append)
            try:
                await register(client, "pinged")
                for _ in range(4):  # pings keep it alive over 40 s of fake time
                    await asyncio.sleep(0.1)
                    await p.clock.run(p.prefill.cfg.engine_timeout_s / 3, step_s=1.0)
                assert [e.engine_id for e in (await client.status()).engines] == ["pinged"]
                p.prefill.registry.mark_gone("pinged", RankId(0, 0), "test")
                for _ in range(40):
                    if lost:
                        break
                    await asyncio.sleep(0.05)
                assert lost and "not registered" in lost[0]
            finally:
                client.close()

    run(body())


class _SlowDeregister(LoopbackTransport):
    """Deregistration takes a while on the NIXL thread, like a real agent's can."""

    started: threading.Event | None = None

    def deregister(self, reg_id: int) -> None:
        assert _SlowDeregister.started is not None
        _SlowDeregister.started.set()
        time.sleep(0.2)
        super().deregister(reg_id)


def test_stop_during_pool_collection_still_frees_the_pool() -> None:
    """Regression: stop() cancelled housekeeping while it deregistered a retired rank's
    pool; the rank was already off the retired list, so its segment leaked."""
    async def body() -> None:
        _SlowDeregister.started = threading.Event()
        prefix = f"kvd-unit-{uuid.uuid4().hex[:8]}"
        clock = FakeClock()
        d = Daemon(config(prefix), transport_factory=_SlowDeregister, clock=clock)
        await d.start()
        client = AsyncKvdClient(d.cfg.engine_address, timeout_s=5, ping_interval_s=0)
        try:
            handle = await register(client, "e")
            handle.pool.close()
            d.registry.mark_gone("e", RankId(0, 0), "test")
            await clock.until(_SlowDeregister.started.is_set, what="collection started")
        finally:
            client.close()
            await d.stop()  # cancels housekeeping mid-deregistration
        assert kvd_segments(prefix) == [], "stop() must free every pool"

    run(body())


def test_drain_timeout_fails_a_reading_pull_after_releasing_its_read() -> None:
    """At drain_timeout_s a pull still reading is failed ``draining``: its READ handle is
    released before its pool is unpinned, and the event says why."""
    async def body() -> None:
        async with daemon_pair(drain_timeout_s=2.0) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [1, 2], lease_s=60)
            transport = p.decode.datapath.transport
            transport.hold_reads = True  # the READ never completes
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await p.clock.until(lambda: transport.counts().transfers == 1, what="READ posted")
            [rank] = p.decode.registry.get("dec").live_ranks()
            assert rank.pins == 1
            drain = asyncio.ensure_future(p.decode.drain())
            await p.clock.run(1.9)
            assert not drain.done() and transport.counts().transfers == 1
            await p.clock.run(0.2)
            await asyncio.wait_for(drain, 5)
            assert transport.counts().transfers == 0 and rank.pins == 0
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert not ev.ok and ev.error.startswith("draining"), ev.error
            assert ev.invalid_block_ids == [5, 6]

    run(body())


def test_a_producer_that_lost_the_hold_mid_read_fails_the_pull() -> None:
    """If the producer no longer holds the request while our READ runs (its lease ended,
    its blocks may be reused), the bytes cannot be trusted: peer_lost, never ok."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [1, 2])
            p.decode.datapath.transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await _until_state(p.dc, p.clock, "pulls", "reading")
            held = p.prefill.producer.held.get("pre", "r1")
            p.prefill.producer.finish(held, "expired")  # as if the lease had run out
            # The pull fails, but its READ still runs: nothing is handed back under it
            # until the transport ends it; meanwhile it is quarantined, and visible.
            await _until_state(p.dc, p.clock, "pulls", "quarantined")
            await p.clock.run(2.0)
            assert [r.state for r in (await p.dc.status()).pulls] == ["quarantined"]
            assert sample(p.decode, "kvd_quarantined_pulls") == 1
            p.decode.datapath.transport.hold_reads = False  # the transport ends the READ
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=3.0)
            assert sample(p.decode, "kvd_quarantined_pulls") == 0
            assert not ev.ok and ev.error.startswith("peer_lost"), ev.error
            assert "no longer holds" in ev.error and ev.invalid_block_ids == [5, 6]
            assert p.decode.datapath.transport.counts().transfers == 0

    run(body())


def test_a_frozen_producer_does_not_expire_a_lease_under_a_running_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer daemon frozen longer than the lease (SIGSTOP, a stalled host) could not
    hear the consumer's heartbeats meanwhile: waking up, it moves its leases on by the
    time it was frozen instead of handing the blocks back under the READ.

    Both daemons share the fake clock, so the jump is a stall of the consumer too; its
    liveness timeout is set past it, as it would have to be for a real producer frozen
    this long to keep its consumer's pull (a pull whose own daemon stalled longer than
    that fails: the producers' leases may have lapsed meanwhile)."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5, peer_liveness_timeout_s=30.0) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [1, 2], lease_s=5.0)

            async def silent(*_: object) -> None:  # its heartbeats are stuck in the freeze
                return None

            monkeypatch.setattr(PullDriver, "_beat", silent)
            p.decode.datapath.transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await _until_state(p.pc, p.clock, "held", "reading")
            p.clock.advance(20.0)  # one jump: the daemon was frozen for 20 s
            await p.clock.run(0.5)
            held = [h.state for h in (await p.pc.status()).held]
            assert held == ["reading"], await p.pc.poll("pre", timeout_s=0.1)
            assert sample(p.prefill, "kvd_leases_expired_total") == 0
            p.decode.datapath.transport.hold_reads = False
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=3.0)
            assert ev.ok, ev.error

    run(body())


def test_one_block_pulls_follow_a_rank_that_registers_again() -> None:
    """The consumer keeps a pull's assembly ready per (engine, peer engine):
    a decode rank that registers again (a new pool) or a producer that does (a new
    handshake) must be read into / from where they are now, byte for byte."""
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 16 * 16)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, list(range(16)))
            addr = p.prefill.cfg.peer_address

            async def pull(rid: str, src: int, dst: int, kv, shape: EngineShape) -> None:
                await p.pc.publish("pre", rid, [src])
                await p.dc.pull("dec", rid, "pre", addr, [src], [dst])
                recv = await wait_event(p.dc, p.clock, "dec", rid, "done_recving")
                assert recv.ok, recv.error
                # block src of the prefill pool holds tokens src*16..: compare that shard
                assert check_shard(kv, g, MODEL, shape, 0, 0, [dst], first_token=src * 16) == 0
                assert (await wait_event(p.pc, p.clock, "pre", rid, "done_sending")).ok

            await pull("r1", 2, 3, dr.kv, SHAPE)
            await pull("r2", 9, 5, dr.kv, SHAPE)  # the ready assembly, reused
            await p.dc.deregister(dr)
            bigger = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=24)
            dr2 = await register(p.dc, "dec", bigger)
            await pull("r3", 4, 20, dr2.kv, bigger)  # a block the old pool did not have
            await p.pc.deregister(pr)
            pr2 = await register(p.pc, "pre")
            write_shard(pr2.kv, g, MODEL, SHAPE, 0, 0, list(range(16)))
            await pull("r4", 11, 7, dr2.kv, bigger)

    run(body())


def test_a_pull_greeting_again_fails_if_its_engine_registered_again() -> None:
    """Found by the fleet simulation (tests/daemon/test_fleet_sim.py, seed 552 of its wide
    schedule): a pull
    whose Acquire reply names a new epoch of the producer discards its early READ and
    greets again; if its own engine left and registered again meanwhile (a new pool),
    the pull must fail, not read into the new pool's blocks (which the new engine never
    gave it)."""
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            addr = p.prefill.cfg.peer_address
            await p.pc.publish("pre", "r0", [0])
            await p.dc.pull("dec", "r0", "pre", addr, [0], [0])
            assert (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
            await p.pc.deregister(pr)
            pr2 = await register(p.pc, "pre")  # a new epoch: the cached handshake is stale
            pr2.kv[...] = 7
            await p.pc.publish("pre", "r1", [1, 2])
            p.decode.datapath.transport.hold_reads = True  # the early READ stays in flight
            await p.dc.pull("dec", "r1", "pre", addr, [1, 2], [5, 6])
            await p.clock.run(0.2)  # the reply came: discarding the READ before greeting
            await p.dc.deregister(dr)
            dr2 = await register(p.dc, "dec")
            dr2.kv[...] = 0
            p.decode.datapath.transport.hold_reads = False
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=5.0)
            assert not ev.ok and "registered again" in ev.error, ev
            assert not dr2.kv.any()  # nothing written into the new pool

    run(body())

"""Two in-process daemons over LoopbackTransport, on an injected clock.

Lease expiry without sleeping through the lease: the test moves the daemons'
clock forward and the housekeeping loop (which runs on real time) expires the
hold by the fake clock. Also a loopback pull checked byte for byte, and an
injected READ failure that reports every local block invalid.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest

from kvd import protocol as P
from kvd.client import AsyncKvdClient
from kvd.config import Config
from kvd.daemon.server import Daemon
from kvd.localcluster import free_port
from kvd.pool import kvd_segments
from kvd.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.transport.loopback import LoopbackTransport

MODEL = P.ModelSpec(name="inproc", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16)


class FakeClock:
    def __init__(self) -> None:
        self.t = 5000.0

    def __call__(self) -> float:
        return self.t


def config(prefix: str, **overrides: float) -> Config:
    settings = {"lease_s": 5.0, "heartbeat_interval_s": 1.0, "handshake_timeout_s": 2.0,
                **overrides}
    return Config(engine_address=f"tcp://127.0.0.1:{free_port()}",
                  peer_address=f"tcp://127.0.0.1:{free_port()}", metrics_port=0,
                  shm_prefix=prefix, **settings)


def sample(d: Daemon, name: str) -> float:
    return d.metrics.registry.get_sample_value(name) or 0.0


async def with_daemons(body: Callable[..., Awaitable[None]], **overrides: float) -> None:
    clock = FakeClock()
    prefix = f"kvd-unit-{uuid.uuid4().hex[:8]}"
    prefill = Daemon(config(prefix, **overrides), transport_factory=LoopbackTransport,
                     clock=clock)
    decode = Daemon(config(prefix, **overrides), transport_factory=LoopbackTransport,
                    clock=clock)
    await prefill.start()
    await decode.start()
    pc = AsyncKvdClient(prefill.cfg.engine_address, timeout_s=5)
    dc = AsyncKvdClient(decode.cfg.engine_address, timeout_s=5)
    try:
        await body(prefill, decode, pc, dc, clock)
    finally:
        pc.close()
        dc.close()
        await prefill.stop()
        await decode.stop()
    assert kvd_segments(prefix) == [], "stop() must free every pool"


async def wait_event(client: AsyncKvdClient, engine_id: str, request_id: str, kind: str
                     ) -> P.Event:
    for _ in range(50):
        for ev in await client.poll(engine_id, timeout_s=0.0):
            if ev.request_id == request_id and ev.kind == kind:
                return ev
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} for {request_id}")


async def register(client: AsyncKvdClient, engine_id: str):
    return await client.register(engine_id, MODEL, layout_spec(SHAPE), 0, 1)


def test_lease_expires_on_the_injected_clock() -> None:
    async def body(prefill, decode, pc, dc, clock) -> None:
        await register(pc, "pre")
        await register(dc, "dec")
        await pc.publish("pre", "r1", [0, 1])  # lease 5 s (config default)
        await asyncio.sleep(0.3)  # several housekeeping rounds: real time is irrelevant
        assert [h["request_id"] for h in (await pc.status()).held] == ["r1"]
        clock.t += 4.9
        await asyncio.sleep(0.2)
        assert len((await pc.status()).held) == 1, "expired before its lease ended"
        clock.t += 0.2
        sent = await wait_event(pc, "pre", "r1", "done_sending")
        assert not sent.ok and sent.error.startswith("lease expired")
        assert (await pc.status()).held == []
        assert sample(prefill, "kvd_leases_expired_total") == 1
        assert sample(prefill, "kvd_held_requests") == 0
        await dc.pull("dec", "r1", "pre", prefill.cfg.peer_address, [0, 1], [2, 3])
        recv = await wait_event(dc, "dec", "r1", "done_recving")
        assert not recv.ok and recv.invalid_block_ids == [2, 3]
        assert "never published" in recv.error

    asyncio.run(with_daemons(body))


def test_acquire_renews_the_lease_by_the_daemon_clock() -> None:
    """A peer's Acquire moves the deadline to now + lease on the producer's own clock."""
    async def body(prefill, decode, pc, dc, clock) -> None:
        await register(pc, "pre")
        await pc.publish("pre", "r1", [0])
        clock.t += 4.0
        prefill.producer.acquire(P.Acquire(request_id="r1", producer_engine_id="pre",
                                           consumer_engine_id="dec", block_ids=[0]))
        clock.t += 4.0  # 8 s after publish, 4 s after the acquire
        await asyncio.sleep(0.2)
        held = (await pc.status()).held
        assert [h["state"] for h in held] == ["reading"]
        assert held[0]["lease_remaining_s"] == pytest.approx(1.0)
        clock.t += 1.0
        sent = await wait_event(pc, "pre", "r1", "done_sending")
        assert not sent.ok

    asyncio.run(with_daemons(body))


def test_loopback_pull_is_byte_exact_and_releases_the_producer() -> None:
    async def body(prefill, decode, pc, dc, clock) -> None:
        p = await register(pc, "pre")
        d = await register(dc, "dec")
        g = global_kv(MODEL, 64)
        write_shard(p.kv, g, MODEL, SHAPE, 0, 0, [3, 5, 7, 9])
        await pc.publish("pre", "r1", [3, 5, 7, 9])
        await dc.pull("dec", "r1", "pre", prefill.cfg.peer_address, [3, 5, 7, 9], [0, 1, 2, 4])
        recv = await wait_event(dc, "dec", "r1", "done_recving")
        assert recv.ok, recv.error
        assert check_shard(d.kv, g, MODEL, SHAPE, 0, 0, [0, 1, 2, 4]) == 0
        sent = await wait_event(pc, "pre", "r1", "done_sending")
        assert sent.ok and sent.nbytes == recv.nbytes > 0

    asyncio.run(with_daemons(body))


def test_injected_read_failure_invalidates_every_local_block() -> None:
    async def body(prefill, decode, pc, dc, clock) -> None:
        await register(pc, "pre")
        await register(dc, "dec")
        await pc.publish("pre", "r1", [0, 1])
        decode.datapath.transport.fail_next_reads = 1
        await dc.pull("dec", "r1", "pre", prefill.cfg.peer_address, [0, 1], [6, 7])
        recv = await wait_event(dc, "dec", "r1", "done_recving")
        assert not recv.ok and recv.invalid_block_ids == [6, 7]
        assert "transfer_failed" in recv.error
        assert (await dc.status()).pulls == []
        assert decode.datapath.transport.counts().transfers == 0, "failed READ not released"
        # No notice came, but the consumer abandoned after releasing its READs: the
        # producer frees the blocks at once, without waiting for the lease (clock unmoved).
        sent = await wait_event(pc, "pre", "r1", "done_sending")
        assert not sent.ok and "abandoned" in sent.error
        assert (await pc.status()).held == []

    asyncio.run(with_daemons(body))


def test_heartbeats_keep_a_slow_pull_alive_past_its_lease() -> None:
    """The consumer renews the lease while its READ runs; the producer never expires it."""
    async def body(prefill, decode, pc, dc, clock) -> None:
        p = await register(pc, "pre")
        d = await register(dc, "dec")
        g = global_kv(MODEL, 32)
        write_shard(p.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
        await pc.publish("pre", "r1", [1, 2])  # lease 5 s on the fake clock
        decode.datapath.transport.hold_reads = True
        await dc.pull("dec", "r1", "pre", prefill.cfg.peer_address, [1, 2], [5, 6])
        for _ in range(50):  # until the READ is posted and in flight
            if [j["state"] for j in (await dc.status()).pulls] == ["reading"]:
                break
            await asyncio.sleep(0.02)
        for _ in range(5):  # 20 s of fake time, 4 s per heartbeat period
            clock.t += 4.0
            await asyncio.sleep(0.35)  # > heartbeat_interval_s of real time
            assert [h["state"] for h in (await pc.status()).held] == ["reading"], \
                "the lease expired although the consumer kept heartbeating"
        decode.datapath.transport.hold_reads = False
        recv = await wait_event(dc, "dec", "r1", "done_recving")
        assert recv.ok, recv.error
        assert check_shard(d.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0
        sent = await wait_event(pc, "pre", "r1", "done_sending")
        assert sent.ok
        assert sample(prefill, "kvd_leases_expired_total") == 0

    asyncio.run(with_daemons(body, heartbeat_interval_s=0.2))


def test_lease_expires_when_the_reading_consumer_is_gone() -> None:
    """No heartbeats (consumer daemon stopped mid-read): the producer's lease ends the hold."""
    async def body(prefill, decode, pc, dc, clock) -> None:
        await register(pc, "pre")
        await register(dc, "dec")
        await pc.publish("pre", "r1", [1, 2])

        async def silent(*_: object) -> None:  # a consumer that went away says nothing
            return None

        decode.consumer._heartbeat = silent
        decode.consumer._abandon = silent
        decode.datapath.transport.hold_reads = True
        await dc.pull("dec", "r1", "pre", prefill.cfg.peer_address, [1, 2], [5, 6])
        for _ in range(50):
            if [h["state"] for h in (await pc.status()).held] == ["reading"]:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # heartbeat periods pass in real time: nothing renews
        assert [h["state"] for h in (await pc.status()).held] == ["reading"]
        clock.t += 5.5
        sent = await wait_event(pc, "pre", "r1", "done_sending")
        assert not sent.ok and sent.error.startswith("lease expired")
        assert sample(prefill, "kvd_leases_expired_total") == 1

    asyncio.run(with_daemons(body, heartbeat_interval_s=0.2))


def test_async_client_pings_and_hears_a_lost_registration() -> None:
    async def body(prefill, decode, pc, dc, clock) -> None:
        lost: list[str] = []
        client = AsyncKvdClient(prefill.cfg.engine_address, timeout_s=5, ping_interval_s=0.05,
                                on_lost=lost.append)
        try:
            await register(client, "pinged")
            await asyncio.sleep(0.3)
            clock.t += prefill.cfg.engine_timeout_s - 1  # pings kept it alive on our clock
            await asyncio.sleep(0.2)
            assert [e["engine_id"] for e in (await client.status()).engines] == ["pinged"]
            prefill.engines.mark_gone("pinged", prefill.engines.get("pinged").live_ranks()[0].rank)
            for _ in range(40):
                if lost:
                    break
                await asyncio.sleep(0.05)
            assert lost and "not registered" in lost[0]
        finally:
            client.close()

    asyncio.run(with_daemons(body))


class _SlowDeregister(LoopbackTransport):
    """Deregistration takes a while on the NIXL thread, like a real agent's can."""

    started = None  # threading.Event, set when a deregistration begins

    def deregister(self, reg_id: int) -> None:
        import time

        assert _SlowDeregister.started is not None
        _SlowDeregister.started.set()
        time.sleep(0.2)
        super().deregister(reg_id)


def test_stop_during_pool_collection_still_frees_the_pool() -> None:
    """Regression: stop() cancelled housekeeping while it deregistered a retired rank's
    pool; the rank was already off the retired list, so its segment leaked."""
    import threading

    async def body() -> None:
        _SlowDeregister.started = threading.Event()
        prefix = f"kvd-unit-{uuid.uuid4().hex[:8]}"
        d = Daemon(config(prefix), transport_factory=_SlowDeregister, clock=FakeClock())
        await d.start()
        client = AsyncKvdClient(d.cfg.engine_address, timeout_s=5, ping_interval_s=0)
        try:
            handle = await register(client, "e")
            handle.pool.close()
            d.engines.mark_gone("e", d.engines.get("e").live_ranks()[0].rank)
            for _ in range(100):  # housekeeping picks the retired rank up
                if _SlowDeregister.started.is_set():
                    break
                await asyncio.sleep(0.01)
            assert _SlowDeregister.started.is_set()
        finally:
            client.close()
            await d.stop()  # cancels housekeeping mid-deregistration
        assert kvd_segments(prefix) == [], "stop() must free every pool"

    asyncio.run(body())

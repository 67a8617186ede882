"""A READ that never ends (NIXL PR #2047) and the bounded quarantine.

In-process daemons over LoopbackTransport, whose ``hold_reads`` keeps a READ in
progress until cleared and whose ``sever_peer`` fails a held READ as NIXL's fail once
their connection is torn down (``severable=False``: a fabric where nothing can be torn
down). The real-NIXL proof, a frozen producer across nodes, is
tests/daemon/pull/test_partition.py::test_a_frozen_producer_never_writes_late.
"""

from __future__ import annotations

import numpy as np
from support.clock import FakeClock
from support.inprocess import daemon_pair, run, sample, wait_event

from kvd.client import AsyncKvdClient
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="quar", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16)
MARK = 0x5A


async def register(client: AsyncKvdClient, engine_id: str):
    return await client.register(engine_id, MODEL, layout_spec(SHAPE), 0, 1)


async def until_pulls(client: AsyncKvdClient, clock: FakeClock, want: list[str]) -> None:
    async def reached() -> bool:
        return [r.state for r in (await client.status()).pulls] == want

    await clock.until(reached, timeout_s=5.0, what=f"pulls {want}")


def pool_of(p, engine_id: str) -> np.ndarray:
    rank = p.decode.registry.get(engine_id).live_ranks()[0]
    return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * rank.pool.nbytes)
                                 .from_address(rank.pool.addr))


def test_a_stuck_read_fails_at_the_deadline_once_its_connection_is_severed() -> None:
    """At transfer_timeout_s the pull's READ connection is severed, and the pull is
    reported failed once the transport has failed the READ (within a poll): the READ's
    bytes never land, even when the producer "resumes"."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5, transfer_timeout_s=2.0,
                               peer_liveness_timeout_s=30.0) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [1, 2])
            pool = pool_of(p, "dec")
            pool[:] = MARK
            transport = p.decode.datapath.transport
            transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await until_pulls(p.dc, p.clock, ["reading"])
            await p.clock.run(1.9)  # before the deadline: nothing reported
            assert await p.dc.poll("dec", timeout_s=0.0) == []
            assert sample(p.decode, "kvd_quarantined_pulls") == 0
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=0.3)
            assert not ev.ok and ev.error.startswith("timeout"), ev.error
            assert ev.invalid_block_ids == [5, 6]
            assert sample(p.decode, "kvd_quarantined_pulls") == 0
            assert sample(p.decode, "kvd_quarantined_bytes") == 0
            assert transport.counts().transfers == 0
            transport.hold_reads = False  # the producer "resumes": nothing is left to land
            await p.clock.run(1.0)
            assert int((pool != MARK).sum()) == 0

    run(body())


def test_a_lost_producer_is_severed_at_once() -> None:
    """When liveness has lost the producer's control connection, the pull fails and its
    READ is severed without waiting for peer_liveness_timeout_s again."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5, peer_liveness_timeout_s=30.0) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            await p.pc.publish("pre", "r1", [1, 2])
            p.decode.datapath.transport.hold_reads = True
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await until_pulls(p.dc, p.clock, ["reading"])
            p.decode.peers.conns[p.prefill.cfg.peer_address].connected = False  # ZMTP lost it
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving", fake_s=0.5)
            assert not ev.ok and ev.error.startswith("peer_lost"), ev.error
            assert "control connection" in ev.error
            assert p.decode.datapath.transport.counts().transfers == 0

    run(body())


def test_quarantine_is_bounded_when_nothing_can_be_severed() -> None:
    """A READ nothing can tear down keeps its pull quarantined (never reported over a READ
    that may land), but at most max_quarantined_pulls: then new pulls fail busy before
    posting, and they work again once the transport ends the stuck READ."""
    async def body() -> None:
        async with daemon_pair(heartbeat_interval_s=0.5, transfer_timeout_s=2.0,
                               peer_liveness_timeout_s=1.0, max_quarantined_pulls=1,
                               lease_s=60.0) as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            transport = p.decode.datapath.transport
            transport.severable = False
            transport.hold_reads = True
            for r in ("r1", "r2", "r3"):
                await p.pc.publish("pre", r, [1, 2])
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await until_pulls(p.dc, p.clock, ["reading"])
            await p.clock.run(10.0)
            assert [r.state for r in (await p.dc.status()).pulls] == ["quarantined"]
            assert sample(p.decode, "kvd_quarantined_pulls") == 1
            assert sample(p.decode, "kvd_quarantined_bytes") > 0
            # A new pull is refused before it posts anything.
            await p.dc.pull("dec", "r2", "pre", p.prefill.cfg.peer_address, [1, 2], [7, 8])
            ev2 = await wait_event(p.dc, p.clock, "dec", "r2", "done_recving")
            assert not ev2.ok and ev2.error.startswith("busy"), ev2.error
            assert "quarantined" in ev2.error and ev2.invalid_block_ids == [7, 8]
            assert transport.counts().transfers == 1  # only the stuck one
            # The transport ends the stuck READ: reported now, and the cap frees up.
            transport.hold_reads = False
            ev1 = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert not ev1.ok and ev1.error.startswith("timeout"), ev1.error
            assert sample(p.decode, "kvd_quarantined_pulls") == 0
            await p.dc.pull("dec", "r3", "pre", p.prefill.cfg.peer_address, [1, 2], [7, 8])
            ev3 = await wait_event(p.dc, p.clock, "dec", "r3", "done_recving")
            assert ev3.ok, ev3.error

    run(body())

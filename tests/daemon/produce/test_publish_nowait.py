"""Publishes that need no reply (no engine step waits on a daemon): the engine picks the
hold id and builds its receipt itself, and a consumer's Acquire that overtakes the
Publish waits for it.

vLLM's connector sends its Publish without waiting (nothing in the engine's step waits
on the daemon) and returns the receipt to vLLM at once; the receipt must name the hold
the daemon then makes, and a Publish still queued toward a frozen daemon when the
consumer's Acquire comes in (another socket) must not turn into "never published".
"""

from __future__ import annotations

import asyncio

import pytest
from support.inprocess import daemon_pair, run, wait_event

from kvd.client import Messages, engine_hold_id
from kvd.daemon.produce import producer as producer_mod
from kvd.errors import NotFoundError, ProtocolError
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="nowait", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16, kv_layout="head_major")


def test_engine_hold_ids_are_above_the_daemons_and_random() -> None:
    ids = {engine_hold_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(P.ENGINE_HOLD_ID_MIN <= i < 2**62 for i in ids)


def test_an_engine_built_receipt_names_the_hold_and_the_pull_reads_the_bytes() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            dr = await p.dc.register("dec", MODEL, layout_spec(SHAPE), 0, 1)
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
            hold_id = engine_hold_id()
            await p.pc.call(Messages.publish("pre", "r1", [1, 2], None, 1, hold_id=hold_id))
            [h] = p.prefill.producer.held.items.values()
            assert h.hold_id == hold_id
            receipt = P.receipt(pr.instance_id, hold_id)  # no reply needed to build it
            task = asyncio.ensure_future(p.dc.pull_and_wait(
                "dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6],
                publish_receipt=receipt))
            await p.clock.until(task.done, timeout_s=10.0, what="the pull's answer")
            assert task.result().ok, task.result().error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0
            # the daemon's own counter is untouched: its next hold is still 1
            await p.pc.publish("pre", "r2", [3])
            assert p.prefill.producer.held.items[("pre", "r2")].hold_id == 1

    run(body())


def test_a_hold_id_in_the_daemons_range_is_refused() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            with pytest.raises(ProtocolError, match="hold_id"):
                await p.pc.call(Messages.publish("pre", "r1", [1], None, 1, hold_id=5))

    run(body())


@pytest.mark.parametrize("publish_after_s", [0.2, None])
def test_an_acquire_that_overtakes_its_publish_waits_for_it(publish_after_s) -> None:
    """The Publish comes 0.2 s after the consumer's Acquire: the pull succeeds. Never
    published: the pull fails ("never published") after the bounded wait, before the
    consumer's Acquire times out."""
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            dr = await p.dc.register("dec", MODEL, layout_spec(SHAPE), 0, 1)
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            if publish_after_s is not None:
                await p.clock.until(lambda: p.prefill.producer._unpublished, timeout_s=5.0,
                                    what="the Acquire waiting for its publish")
                await p.clock.run(publish_after_s, step_s=0.01)
                await p.pc.publish("pre", "r1", [1, 2])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            if publish_after_s is None:
                assert not ev.ok and "never published" in ev.error, ev
            else:
                assert ev.ok, ev.error
                assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0
            assert not p.prefill.producer._unpublished

    run(body())


def test_without_the_wait_an_overtaking_acquire_fails(monkeypatch) -> None:
    """The wait is what saves the pull above (the test fails without it)."""
    monkeypatch.setattr(producer_mod, "ACQUIRE_WAITS_FOR_PUBLISH_S", 0.0)

    async def body() -> None:
        async with daemon_pair() as p:
            await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            await p.dc.register("dec", MODEL, layout_spec(SHAPE), 0, 1)
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await p.clock.run(0.2, step_s=0.01)
            await p.pc.publish("pre", "r1", [1, 2])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert not ev.ok

    run(body())


def test_an_acquire_waiting_for_its_publish_holds_up_no_other_peer_message() -> None:
    """r1's Acquire overtakes its Publish and waits (up to a second); r2, published, is
    pulled meanwhile from the same consumer daemon: its Acquire is answered and its pull
    done while r1's still waits. Before, the peer face answered one request at a time,
    so every Acquire, heartbeat and notice queued behind a waiting one."""
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            dr = await p.dc.register("dec", MODEL, layout_spec(SHAPE), 0, 1)
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])  # r1's first two blocks
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [3])  # r2's first block
            await p.pc.publish("pre", "r2", [3])
            # the handshake first, so that r1's Acquire is what waits
            await p.dc.pull("dec", "r0", "pre", p.prefill.cfg.peer_address, [1], [4])
            assert not (await wait_event(p.dc, p.clock, "dec", "r0", "done_recving")).ok
            await p.dc.pull("dec", "r1", "pre", p.prefill.cfg.peer_address, [1, 2], [5, 6])
            await p.clock.until(lambda: p.prefill.producer._unpublished, timeout_s=5.0,
                                what="r1's Acquire waiting for its publish")
            await p.dc.pull("dec", "r2", "pre", p.prefill.cfg.peer_address, [3], [7])
            ev = await wait_event(p.dc, p.clock, "dec", "r2", "done_recving", fake_s=0.5)
            assert ev.ok, ev.error
            assert ("pre", "r1") in p.prefill.producer._unpublished  # still waiting
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [7]) == 0
            await p.pc.publish("pre", "r1", [1, 2])
            ev = await wait_event(p.dc, p.clock, "dec", "r1", "done_recving")
            assert ev.ok, ev.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0

    run(body())


def test_an_abandon_ends_its_consumers_waiting_acquire_with_a_refusal() -> None:
    """Answered out of order, an Acquire still waiting for its Publish must not take a
    hold its consumer has already abandoned (the hold would wait out its lease)."""
    async def body() -> None:
        async with daemon_pair() as p:
            await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
            producer = p.prefill.producer
            acq = P.Acquire(request_id="r1", producer_engine_id="pre",
                            consumer_engine_id="dec", block_ids=[1, 2])
            other = P.Acquire(request_id="r1", producer_engine_id="pre",
                              consumer_engine_id="dec2", block_ids=[1, 2])
            assert producer.acquire_must_wait(acq)
            mine = asyncio.ensure_future(producer.acquire_when_published(acq, "i1"))
            theirs = asyncio.ensure_future(producer.acquire_when_published(other, "i2"))
            await p.clock.until(lambda: len(producer._unpublished.get(("pre", "r1"), ())) == 2,
                                timeout_s=1.0, what="both Acquires waiting")
            with pytest.raises(NotFoundError):  # nothing held yet: the Abandon is refused
                producer.abandon(P.Abandon(request_id="r1", producer_engine_id="pre",
                                           consumer_engine_id="dec"))
            await p.clock.until(mine.done, timeout_s=0.1, what="the abandoned Acquire")
            with pytest.raises(NotFoundError, match="abandoned"):
                mine.result()
            await p.pc.publish("pre", "r1", [1, 2])
            await p.clock.until(theirs.done, timeout_s=0.1, what="the other consumer's")
            assert isinstance(theirs.result(), P.Acquired)
            assert set(producer.held.get("pre", "r1").readers) == {"dec2"}

    run(body())

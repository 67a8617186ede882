"""Publishes that need no reply (issue 20): the engine picks the hold id and builds its
receipt itself, and a consumer's Acquire that overtakes the Publish waits for it.

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
from kvd.daemon import producer as producer_mod
from kvd.errors import ProtocolError
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

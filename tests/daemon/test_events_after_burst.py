"""A burst's events leave together: event deliveries wait until the engine face has read
every request waiting on it (kvd.daemon.events.AfterBurst), at most BURST_HOLD_S.

The unit tests drive AfterBurst on a real event loop with the face's "waiting" stubbed;
the end-to-end test sends six local pulls in one ``batch()`` to a real ``kvd serve``
(as a decode engine's step does: over the direct door, one write) with an acknowledged
poll parked before them, and reads the poll's one reply: all six ``done_recving``
events in it. Before, each event was delivered at the loop turn after its pull, and
the face yields the loop every 2 ms, so with copies of a few ms the first reply
carried one or two of them.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from support.cluster import start_daemon, stop_and_check_clean

from kvd.client import EventCursor
from kvd.client.core import Messages
from kvd.client.nowait import NoWaitClient
from kvd.daemon.events import AfterBurst
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec


def test_deliveries_wait_while_the_face_has_requests_waiting() -> None:
    ran: list[str] = []
    waiting = [True, True, False]

    async def run() -> None:
        gate = AfterBurst(time.monotonic, hold_s=10.0)
        gate.waiting = lambda: waiting.pop(0) if waiting else False
        gate.schedule(lambda: ran.append("a"))
        gate.schedule(lambda: ran.append("b"))
        assert ran == []  # never inside the call that schedules
        for _ in range(2):
            await asyncio.sleep(0)
            assert ran == []  # the face still has requests to read
        await asyncio.sleep(0)
        assert ran == ["a", "b"] and gate.held == 2

    asyncio.run(run())


def test_a_face_that_never_runs_dry_holds_a_delivery_at_most_hold_s() -> None:
    ran: list[float] = []
    now = [0.0]

    async def run() -> None:
        gate = AfterBurst(lambda: now[0], hold_s=0.03)
        gate.waiting = lambda: True
        gate.schedule(lambda: ran.append(now[0]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert ran == []
        now[0] = 0.03
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert ran == [0.03]

    asyncio.run(run())


MODEL = ModelSpec(name="burst", num_kv_heads=2, num_layers=4, head_dim=64, dtype="float32")
SHAPE = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=512)  # 128 KiB blocks
PULLS = 6
BLOCKS = 31  # 3.9 MiB a pull: copied inline (<= 4 MiB), each 1-2 ms


@pytest.mark.nixl
def test_six_pulls_sent_together_report_in_one_poll_reply(tmp_path) -> None:
    d = start_daemon(tmp_path, "burst")
    nowait = NoWaitClient(d.engine_address)
    poller = NoWaitClient(d.engine_address)
    try:
        with d.client(ping_interval_s=0, timeout_s=30) as c:
            p = c.register("pre", MODEL, layout_spec(SHAPE))
            c.register("dec", MODEL, layout_spec(SHAPE))
            p.kv.reshape(-1).view(np.uint8)[:] = 3
            cursor = EventCursor("dec")
            ids = list(range(PULLS * BLOCKS))
            # a first pull alone: the pair's first is not the subject here
            receipt = c.publish("pre", "warm", ids[:BLOCKS])
            assert nowait.send(Messages.pull("dec", "warm", "pre", d.peer_address,
                                             ids[:BLOCKS], ids[:BLOCKS], "warm",
                                             num_tokens=-1, publish_receipt=receipt),
                               "warm", time.monotonic())
            while not any(e.request_id == "warm" for e in cursor.take()):
                assert poller.send(cursor.poll(timeout_s=5.0), "poll", time.monotonic())
                assert poller.wait_reply(10.0)
                for r in poller.replies():
                    if r.tag == "poll":
                        cursor.accept(r.body)
            c.wait("pre", "warm", "done_sending", timeout_s=20)
            rounds = []
            for rnd in range(2):  # the second: pools warm, copies of a few ms each
                held = [(f"r{rnd}-{k}", ids[k * BLOCKS:(k + 1) * BLOCKS])
                        for k in range(PULLS)]
                receipts = [c.publish("pre", rid, src) for rid, src in held]
                assert poller.send(cursor.poll(timeout_s=20.0), "poll", time.monotonic())
                time.sleep(0.3)  # the poll is parked
                with nowait.batch():  # as the connector sends a step's pulls
                    for (rid, blocks), receipt in zip(held, receipts, strict=True):
                        pull = Messages.pull("dec", rid, "pre", d.peer_address, blocks,
                                             blocks, rid, num_tokens=-1,
                                             publish_receipt=receipt)
                        assert nowait.send(pull, rid, time.monotonic())
                assert poller.wait_reply(20.0)
                [reply] = [r for r in poller.replies() if r.tag == "poll"]
                cursor.accept(reply.body)
                events = [e for e in cursor.take() if e.kind == "done_recving"]
                rounds.append(sorted(e.request_id for e in events))
                assert all(e.ok for e in events), [e.error for e in events]
                for rid, _ in held:
                    c.wait("pre", rid, "done_sending", timeout_s=20)
            assert rounds == [sorted(f"r{rnd}-{k}" for k in range(PULLS))
                              for rnd in range(2)]
    finally:
        nowait.close()
        poller.close()
        stop_and_check_clean(d)

"""Publish receipts and pulls answered when done, on in-process daemons.

A receipt proves the publish happened before the Pull was sent: the consumer then posts
READs before the Acquire's reply at any size and never reads again for a young hold.
A Pull with ``reply_when_done`` is answered with its done_recving event, which no poll
sees.
"""

from __future__ import annotations

import asyncio

import pytest
from support.inprocess import daemon_pair, run, wait_event

from kvd.client import AsyncKvdClient
from kvd.daemon.peers.remote import RemoteDaemon
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull import machine
from kvd.daemon.pull.acquire import Replies, may_predate_publish, receipted
from kvd.daemon.pull.acquiring import Acquiring
from kvd.errors import BlockIdError
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="receipt", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16, kv_layout="head_major")


async def register(client: AsyncKvdClient, engine_id: str):
    return await client.register(engine_id, MODEL, layout_spec(SHAPE), 0, 1)


async def pull_and_wait(p, *args, **kwargs) -> P.Event:
    """The call runs while the fake clock moves (its pull sleeps on that clock)."""
    task = asyncio.ensure_future(p.dc.pull_and_wait(*args, **kwargs))
    await p.clock.until(task.done, timeout_s=10.0, what="the pull's answer")
    return task.result()


def test_publish_answers_a_receipt_naming_this_incarnation_and_hold() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            await register(p.pc, "pre")
            r1 = await p.pc.publish("pre", "r1", [0])
            r2 = await p.pc.publish("pre", "r2", [1])
            instance = p.prefill.instance_id
            assert r1.startswith(instance + "/") and r2.startswith(instance + "/")
            assert r1 != r2, "two holds must not share a receipt"

    run(body())


def test_a_receipted_pull_is_byte_exact_answered_when_done_and_not_queued() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2, 3])
            receipt = await p.pc.publish("pre", "r1", [1, 2, 3])
            ev = await pull_and_wait(p, "dec", "r1", "pre", p.prefill.cfg.peer_address,
                                     [1, 2, 3], [7, 8, 9], publish_receipt=receipt)
            assert ev.kind == "done_recving" and ev.request_id == "r1" and ev.ok, ev.error
            assert ev.nbytes > 0
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [7, 8, 9]) == 0
            sent = await wait_event(p.pc, p.clock, "pre", "r1", "done_sending")
            assert sent.ok
            assert await p.dc.poll("dec", timeout_s=0.0) == [], \
                "an event answered to its Pull must not be delivered to polls too"

    run(body())


def test_a_pull_answered_when_done_reports_its_failure_in_the_answer() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            await register(p.pc, "pre")
            await register(p.dc, "dec")
            ev = await pull_and_wait(p, "dec", "never", "pre", p.prefill.cfg.peer_address,
                                     [1], [4])
            assert not ev.ok and ev.invalid_block_ids == [4]
            assert "never published" in ev.error
            with pytest.raises(BlockIdError, match="out of range"):  # refused at once
                await p.dc.pull_and_wait("dec", "bad", "pre", p.prefill.cfg.peer_address,
                                         [1], [999])

    run(body())


def _order_of_post_and_reply(monkeypatch: pytest.MonkeyPatch, with_receipt: bool
                             ) -> list[str]:
    """Every pull counts as big (> EARLY_POST_MAX_BYTES): in which order did the READ go
    out and the Acquire's replies get settled?"""
    monkeypatch.setattr(machine, "EARLY_POST_MAX_BYTES", 0)
    order: list[str] = []
    wait = Acquiring.wait

    async def wait_and_note(self: Acquiring) -> list[object]:
        got = await wait(self)
        order.append("replies")
        return got

    monkeypatch.setattr(Acquiring, "wait", wait_and_note)
    # the replies are never in before the pull looks (as over a real network)
    monkeypatch.setattr(Acquiring, "answered", property(lambda self: False))
    monkeypatch.setattr(Acquiring, "ready", lambda self: None)

    async def body() -> None:
        async with daemon_pair() as p:
            pr = await register(p.pc, "pre")
            dr = await register(p.dc, "dec")
            g = global_kv(MODEL, 32)
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [1, 2])
            post = p.decode.datapath._post_reads  # inline or on the NIXL thread: both

            def post_and_note(posts):
                order.append("post")
                return post(posts)

            p.decode.datapath._post_reads = post_and_note
            # first pull: the handshake (then cached, so the next Acquire leaves early)
            await p.pc.publish("pre", "warm", [1, 2])
            assert (await pull_and_wait(p, "dec", "warm", "pre", p.prefill.cfg.peer_address,
                                        [1, 2], [5, 6])).ok
            order.clear()
            receipt = await p.pc.publish("pre", "r1", [1, 2])
            ev = await pull_and_wait(p, "dec", "r1", "pre", p.prefill.cfg.peer_address,
                                     [1, 2], [5, 6],
                                     publish_receipt=receipt if with_receipt else "")
            assert ev.ok, ev.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [5, 6]) == 0

    run(body())
    return order


def test_a_receipt_lets_a_big_pull_post_before_the_acquire_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _order_of_post_and_reply(monkeypatch, with_receipt=True)[0] == "post"


def test_without_a_receipt_a_big_pull_waits_for_the_acquire_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _order_of_post_and_reply(monkeypatch, with_receipt=False)[0] == "replies"


# ------------------------------------------------------------ the read-again rule


class _Judged:
    """The read-again rules (kvd.daemon.pull.acquire) over one pull and its replies."""

    def __init__(self, msg: P.Pull, daemons: dict[str, RemoteDaemon], replies: Replies
                 ) -> None:
        self.msg, self.daemons, self.replies = msg, daemons, replies

    def may_predate_publish(self, agent: str, posted_s: float) -> bool:
        return may_predate_publish(self.msg, self.daemons, self.replies, agent, posted_s)

    def receipted(self, agent: str) -> bool:
        return receipted(self.msg, self.daemons, agent)


def _acquiring(receipt: str, reply_instance: str, hold_id: int, held_s: float) -> _Judged:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address="tcp://p:1", remote_block_ids=[1], local_block_ids=[2],
                 publish_receipt=receipt)
    daemons = {"tcp://p:1": RemoteDaemon("tcp://p:1", agent="agent-p", instance="inst-a",
                                         epoch=1)}
    return _Judged(msg, daemons, Replies({"tcp://p:1": Reply(
        body=P.Acquired(epoch=1, held_s=held_s, hold_id=hold_id), instance=reply_instance,
        received_s=10.0)}))


@pytest.mark.parametrize(("receipt", "reply_instance", "hold_id", "predates"), [
    ("", "inst-a", 7, True),  # no receipt: the young hold may postdate the READ
    ("inst-a/7", "inst-a", 7, False),  # the receipt's hold: older than the Pull
    ("inst-a/6", "inst-a", 7, True),  # another hold of the same id: republished since
    ("inst-b/7", "inst-a", 7, True),  # another incarnation's hold 7
])
def test_only_the_receipted_hold_is_exempt_from_reading_again(
        receipt: str, reply_instance: str, hold_id: int, predates: bool) -> None:
    # held 0.5 s when the Acquire came, 1 s after the READ was posted: too young
    acq = _acquiring(receipt, reply_instance, hold_id, held_s=0.5)
    assert acq.may_predate_publish("agent-p", posted_s=9.0) is predates
    # a hold older than post -> reply never needs a read-again
    assert not _acquiring(receipt, reply_instance, hold_id, held_s=2.0).may_predate_publish(
        "agent-p", posted_s=9.0)


def test_receipted_needs_the_cached_incarnation_of_the_daemon() -> None:
    assert _acquiring("inst-a/7", "inst-a", 7, 0.0).receipted("agent-p")
    assert not _acquiring("inst-b/7", "inst-a", 7, 0.0).receipted("agent-p")
    assert not _acquiring("", "inst-a", 7, 0.0).receipted("agent-p")
    assert not _acquiring("inst-a/7", "inst-a", 7, 0.0).receipted("agent-q")  # no daemon

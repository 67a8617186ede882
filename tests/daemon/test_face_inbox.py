"""kvd.daemon.faces.Inbox: a face's receive without pyzmq's asyncio adapter.

ZMQ's descriptor only says "the socket's events may have changed", and any call on the
socket (a send, reading ZMQ_EVENTS) may consume that signal while a message stays
queued. The inbox reads EVENTS before it waits, and every send on a face kicks it, so a
request is never stranded (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import time

import uvloop
import zmq
import zmq.asyncio

from kvd.daemon.faces import Face, Inbox
from kvd.ops.metrics import Metrics
from kvd.tools.localcluster import free_port
from kvd.wire import protocol as P


def _pair(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(f"inproc://{name}")
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"inproc://{name}")
    return server, client


def test_a_send_that_consumed_the_wakeup_strands_nothing_once_kicked() -> None:
    """A request arrives while the loop is held, and a send on the same socket in that
    loop step consumes the descriptor's signal: the waiting receive sleeps until kicked
    (what `Face.send` does after every send), then takes the request at once."""

    async def body() -> None:
        ctx = zmq.Context()
        server, client = _pair(ctx, "inbox-kick")
        inbox = Inbox(server)
        try:
            client.send(b"hello")  # the connection: its identity first
            ident, first = await asyncio.wait_for(inbox.recv(), 2)
            waiting = asyncio.ensure_future(inbox.recv())
            await asyncio.sleep(0.01)  # the receive now waits on the descriptor
            client.send(b"second")
            time.sleep(0.05)  # the loop held: the request reaches the socket meanwhile
            server.send_multipart([ident.bytes, b"reply"])  # consumes the signal
            await asyncio.sleep(0.2)
            assert not waiting.done(), "the descriptor did not signal again (test premise)"
            inbox.kick()
            got = await asyncio.wait_for(waiting, 1)
            assert [f.bytes for f in got[1:]] == [b"second"]
            assert first.bytes == b"hello"
        finally:
            inbox.close()
            server.close(0)
            client.close(0)
            ctx.term()

    uvloop.run(body())


def test_requests_that_come_while_the_face_is_busy_are_all_answered_in_order() -> None:
    """While the face's one handler waits (200 ms), requests keep arriving over TCP (each
    signalled through the socket's descriptor while nobody receives): every one is
    answered, in order, and the inbox is woken a few times, not once per loop turn."""

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{free_port()}"  # messages come through the I/O thread
        face = Face(ctx, "engine", address, P.ENGINE_REQUESTS, 1 << 20, 1 << 23, "", "inst",
                    Metrics())
        kicks = 0
        kick = face.inbox.kick

        def counted() -> None:
            nonlocal kicks
            kicks += 1
            kick()

        loop = asyncio.get_running_loop()
        loop.remove_reader(face.sock.getsockopt(zmq.FD))
        face.inbox.kick = counted  # type: ignore[method-assign]
        face.inbox._loop = None  # registered again, with the counting callback
        order: list[str] = []

        async def ping(m: P.Ping, _req: object) -> P.Ok:
            order.append(m.engine_id)
            if m.engine_id == "slow":
                await asyncio.sleep(0.2)
            return P.Ok()

        client = zmq.Socket(ctx, zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(address)
        serve = asyncio.ensure_future(face.serve({P.Ping: ping}))
        try:
            names = ["slow", *(f"e{i}" for i in range(5))]
            for i, name in enumerate(names):
                client.send_multipart(P.encode(P.Ping(engine_id=name, tp_rank=0), i + 1))
                await asyncio.sleep(0.01)
            replies = []
            deadline = time.monotonic() + 3
            while len(replies) < len(names) and time.monotonic() < deadline:
                try:
                    replies.append(P.decode(client.recv_multipart(zmq.NOBLOCK), P.REPLIES))
                except zmq.Again:
                    await asyncio.sleep(0.005)
            assert [h.id for h, _ in replies] == list(range(1, len(names) + 1))
            assert order == names
            assert kicks < 50, f"{kicks} wake-ups in 200 ms"
        finally:
            serve.cancel()
            face.close()
            client.close(0)
            ctx.term()

    uvloop.run(body())


def test_every_reply_a_face_sends_kicks_its_inbox() -> None:
    """The other half of the first test: `Face.send` (every reply, also the ones sent
    later by other tasks) kicks the inbox after sending."""
    ctx = zmq.asyncio.Context()
    face = Face(ctx, "engine", "inproc://inbox-send", P.ENGINE_REQUESTS, 1 << 20, 1 << 23,
                "", "inst", Metrics())
    kicked: list[bool] = []
    face.inbox.kick = lambda: kicked.append(True)  # type: ignore[method-assign]
    try:
        face.send(b"nobody", 7, P.Ok())  # dropped (no such peer), kicked all the same
        assert kicked == [True]
    finally:
        face.close()
        ctx.term()

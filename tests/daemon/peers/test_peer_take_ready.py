"""Replies a daemon takes from a peer socket without a loop turn.

A consumer that kept its event loop busy posting a READ inline finds the Acquire's
reply already queued; ``PeerConnection.take_ready`` hands it over at once instead of
one to two loop turns later through the reader task. It must never starve that
reader: ZMQ's socket descriptor is edge-triggered, and a receive outside pyzmq's
asyncio wrapper must not make it miss a later reply.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import zmq
import zmq.asyncio
from support.inprocess import run

from kvd.daemon.clock import MonotonicClock
from kvd.daemon.peers.conn import PeerConnection
from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.acquire import Replies
from kvd.daemon.pull.acquiring import Acquiring
from kvd.tools.localcluster import free_port
from kvd.wire import protocol as P

BEAT = P.Heartbeat(producer_engine_id="pre", request_ids=[])


@contextmanager
def answering_peer() -> Iterator[str]:
    """A peer daemon's face, reduced to answering every request, on its own thread: it
    answers while the test blocks the event loop."""
    address = f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    ready = threading.Event()

    def serve() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        ready.set()
        while not stop.is_set():
            if sock.poll(20):
                identity, header, _ = sock.recv_multipart()
                msg_id = P.decode_header(header).id
                sock.send_multipart([identity, *P.encode(P.HeartbeatAck(unknown=[]), msg_id,
                                                         instance="peer-1")])
        sock.close(0)
        ctx.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(5)
    try:
        yield address
    finally:
        stop.set()
        thread.join(5)


def queued(conn: PeerConnection, timeout_s: float = 5.0) -> None:
    """Block the loop (as an inline READ does) until a reply waits on the socket."""
    deadline = time.monotonic() + timeout_s
    while not conn._now.get(zmq.EVENTS) & zmq.POLLIN:
        assert time.monotonic() < deadline, "the peer never answered"
        time.sleep(0.001)


def test_a_reply_queued_while_the_loop_was_busy_is_taken_at_once() -> None:
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        with answering_peer() as address:
            conn = PeerConnection(ctx, address, "", "me", 1 << 20, MonotonicClock(),
                                  lambda *_: None)
            try:
                for _ in range(5):
                    fut = conn.send(BEAT, timeout_s=5.0)
                    queued(conn)
                    assert not fut.done()  # the reader task has not run: no loop turn yet
                    assert conn.take_ready() == 1
                    assert fut.done() and isinstance(fut.result().body, P.HeartbeatAck)
                    assert fut.result().instance == "peer-1"
                    assert conn.take_ready() == 0  # nothing else queued
                    # and the reader still hears the next reply by itself (edge-triggered
                    # descriptor: the receive outside pyzmq must not hide it)
                    reply = await asyncio.wait_for(conn.request(BEAT, timeout_s=5.0), 5.0)
                    assert isinstance(reply.body, P.HeartbeatAck)
                # several replies queued at once are all taken, still without a loop turn
                futs = [conn.send(BEAT, timeout_s=5.0) for _ in range(3)]
                deadline = time.monotonic() + 5.0
                taken = 0
                while taken < 3 and time.monotonic() < deadline:
                    queued(conn)
                    taken += conn.take_ready()
                assert taken == 3 and all(f.done() for f in futs)
                reply = await asyncio.wait_for(conn.request(BEAT, timeout_s=5.0), 5.0)
                assert isinstance(reply.body, P.HeartbeatAck)
            finally:
                conn.close()
        ctx.term()

    run(body())


def test_settle_takes_queued_replies_before_it_waits() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        taken: list[list[str]] = []

        def take_ready(addrs) -> None:
            taken.append(list(addrs))
            fut.set_result(Reply(P.Acquired(epoch=1), "inst-a", 1.0))

        msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                     remote_address="tcp://p:1", remote_block_ids=[1], local_block_ids=[2])
        remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type] - unused here
            "tcp://p:1": RemoteDaemon("tcp://p:1", agent="agent-p", instance="inst-a",
                                      epoch=1)})
        acq = Acquiring({"tcp://p:1": fut}, take_ready)
        # settled in this very step: nothing else may run on the loop meanwhile
        step = asyncio.ensure_future(acq.wait())
        await asyncio.sleep(0)
        assert step.done()
        assert Replies(dict(zip(acq.addresses, step.result(), strict=True))).current(
            remote.daemons) is True
        assert msg.remote_address in acq.addresses
        assert taken == [["tcp://p:1"]]

    run(body())


def test_a_reply_that_came_while_this_daemon_stalled_beats_the_request_timer() -> None:
    """The daemon's own loop does not run past a request's deadline (a CPU-starved host;
    the chaos soak saw a decode daemon stalled 2.2 s against a 2 s Acquire timeout) while
    the peer's reply arrives: when the loop runs again the expiry must take the queued
    reply, not fail the request as unanswered (it failed ``timeout`` before)."""
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        with answering_peer() as address:
            conn = PeerConnection(ctx, address, "", "me", 1 << 20, MonotonicClock(),
                                  lambda *_: None)
            try:
                # connected first, so the expiry below is the plain "did not answer" one
                await asyncio.wait_for(conn.request(BEAT, timeout_s=5.0), 5.0)
                for _ in range(3):
                    fut = conn.send(BEAT, timeout_s=0.2)
                    queued(conn)  # the reply waits on the socket; the loop is blocked
                    time.sleep(0.3)  # ... past the request's deadline (the stall)
                    reply = await asyncio.wait_for(fut, 5.0)
                    assert isinstance(reply.body, P.HeartbeatAck)
            finally:
                conn.close()
        ctx.term()

    run(body())

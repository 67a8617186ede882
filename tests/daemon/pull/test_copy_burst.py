"""The small copies of a burst of local pulls run together, when the face has read the
burst (kvd.daemon.pull.burst): posted while more requests wait, a copy is queued, and
every queued copy ends in the same loop turn; a single pull still copies inline.
Real copies between numpy buffers; the face's "more waiting" is a stub here, a real
ZMQ socket in the Inbox test."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import zmq

from kvd.daemon.faces import Inbox
from kvd.daemon.pull.local import LocalMover
from kvd.transport.base import ReadPost, XferState
from kvd.transport.copies.localcopy import LocalCopier


def _post(src: np.ndarray, dst: np.ndarray) -> ReadPost:
    return ReadPost(peer="self", local_addrs=np.array([dst.ctypes.data], dtype=np.uint64),
                    remote_addrs=np.array([src.ctypes.data], dtype=np.uint64),
                    nbytes=np.array([src.nbytes], dtype=np.uint64), mem_type="DRAM",
                    notif=b"")


def _buffers(k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    srcs = [np.full(1 << 16, i + 1, dtype=np.uint8) for i in range(k)]
    return srcs, [np.zeros_like(s) for s in srcs]


def test_copies_posted_while_requests_wait_end_together_in_the_next_loop_turn() -> None:
    mover = LocalMover(LocalCopier(threads=1))
    waiting = [True, True, False]  # the face: two more requests wait, then none
    mover.more_waiting = lambda: waiting.pop(0) if waiting else False
    srcs, dsts = _buffers(3)

    async def run() -> None:
        handles = []
        for s, d in zip(srcs, dsts, strict=True):  # as three Pull handlers would, in turn
            [res] = mover.post_now([_post(s, d)])
            assert res.xfer_id is not None and not res.done  # queued, not copied
            handles.append(res.xfer_id)
        # the third came with nothing more waiting: it joins the queued burst
        assert all(not d.any() for d in dsts)
        states = mover._states(handles)
        assert {st.state for st in states.values()} == {XferState.PENDING}
        await asyncio.sleep(0)  # the face has read the burst: the loop's next turn
        states = mover._states(handles)
        assert {st.state for st in states.values()} == {XferState.DONE}
        assert all((d == s).all() for s, d in zip(srcs, dsts, strict=True))
        assert (mover.burst.flushes, mover.burst.copies) == (1, 3)
        polled = await mover.poll(handles)  # the pull's own poll: no wait
        assert {st.state for st in polled.values()} == {XferState.DONE}
        await mover.release(handles)

    asyncio.run(run())
    mover.close()


def test_a_single_pull_with_nothing_waiting_copies_inline() -> None:
    mover = LocalMover(LocalCopier(threads=1))
    mover.more_waiting = lambda: False
    [src], [dst] = _buffers(1)

    async def run() -> None:
        [res] = mover.post_now([_post(src, dst)])
        assert res.done and (dst == src).all()
        assert mover.burst.flushes == 0

    asyncio.run(run())
    mover.close()


def test_a_queued_copy_released_before_the_flush_never_writes() -> None:
    mover = LocalMover(LocalCopier(threads=1))
    mover.more_waiting = lambda: True
    srcs, dsts = _buffers(2)

    async def run() -> None:
        [a] = mover.post_now([_post(srcs[0], dsts[0])])
        [b] = mover.post_now([_post(srcs[1], dsts[1])])
        await mover.release([a.xfer_id])  # its pull failed meanwhile: memory given back
        await asyncio.sleep(0)
        assert not dsts[0].any()  # never copied into released memory
        assert (dsts[1] == srcs[1]).all()
        assert mover.burst.copies == 1
        await mover.release([b.xfer_id])

    asyncio.run(run())
    mover.close()


def test_asking_the_inbox_whether_a_message_waits_wakes_its_receive() -> None:
    # Reading EVENTS consumes the socket's descriptor signal: a receive waiting on the
    # loop would never hear of the message if the question did not wake it.
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    inbox = Inbox(server)

    async def run() -> list[bytes]:
        recv = asyncio.ensure_future(inbox.recv())
        await asyncio.sleep(0.05)  # waiting on the descriptor
        client.send(b"hello")
        for _ in range(2000):  # until it is there, asked without a loop turn (as a
            if inbox.waiting():  # post asks, inside some other handler or task)
                break
            time.sleep(0.001)
        frames = await asyncio.wait_for(recv, 2.0)
        return [f.bytes for f in frames]

    try:
        assert asyncio.run(run())[-1] == b"hello"
    finally:
        inbox.close()
        client.close(0)
        server.close(0)
        ctx.term()

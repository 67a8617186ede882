"""`LocalMover` hears of a copy's end at once: a waiter thread wakes the pull's poll,
instead of the pull's poll backoff (up to 2 ms, rounded up by the event loop's
millisecond timers) finding it later. Real copies into numpy buffers; the copy call
is gated so the test decides when a copy ends."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from kvd.daemon.pull import local as localmod
from kvd.daemon.pull.local import LocalMover
from kvd.transport.base import ReadPost, XferState
from kvd.transport.copies.localcopy import LocalCopier, memmove_copy


class Gate:
    """A copy call that blocks until opened (or raises, if told to)."""

    def __init__(self, fail: bool = False) -> None:
        self.open = threading.Event()
        self.fail = fail

    def __call__(self, dst: int, src: int, nbytes: int) -> None:
        self.open.wait(10)
        if self.fail:
            raise OSError("copy went wrong")
        memmove_copy(dst, src, nbytes)


def _post(src: np.ndarray, dst: np.ndarray) -> ReadPost:
    n = src.nbytes
    return ReadPost(peer="self", local_addrs=np.array([dst.ctypes.data], dtype=np.uint64),
                    remote_addrs=np.array([src.ctypes.data], dtype=np.uint64),
                    nbytes=np.array([n], dtype=np.uint64), mem_type="DRAM", notif=b"")


def _mover(gate: Gate) -> LocalMover:
    return LocalMover(LocalCopier(threads=1, inline_max_nbytes=0, copy_fn=gate))


def test_poll_returns_done_as_soon_as_the_copy_ends(monkeypatch) -> None:
    # A poll not woken waits WAKE_WAIT_S, then reads DONE all the same: only its time
    # tells the two apart. A long wait makes that tell a host's slowness from a missed
    # wake-up (0.05 s, the default, is one busy host's scheduling hiccup).
    monkeypatch.setattr(localmod, "WAKE_WAIT_S", 5.0)
    gate = Gate()
    mover = _mover(gate)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)

    async def run() -> tuple[XferState, float]:
        [res] = mover.post_now([_post(src, dst)])
        assert res.xfer_id is not None and not res.done
        asyncio.get_running_loop().call_later(0.01, gate.open.set)
        t0 = time.perf_counter()
        states = await mover.poll([res.xfer_id])  # one poll: woken by the copy's end
        elapsed = time.perf_counter() - t0
        await mover.release([res.xfer_id])
        return states[res.xfer_id].state, elapsed

    try:
        state, elapsed = asyncio.run(run())
    finally:
        mover.close()
    assert state is XferState.DONE  # before the waiter, one poll said PENDING
    assert elapsed < localmod.WAKE_WAIT_S
    assert np.array_equal(dst, src)
    assert mover.copier.counts().handles == 0


def test_poll_waits_at_most_its_bound_for_a_copy_that_goes_on(monkeypatch) -> None:
    monkeypatch.setattr(localmod, "WAKE_WAIT_S", 0.02)
    gate = Gate()
    mover = _mover(gate)
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros_like(src)

    async def run() -> tuple[XferState, float, XferState]:
        [res] = mover.post_now([_post(src, dst)])
        t0 = time.perf_counter()
        first = (await mover.poll([res.xfer_id]))[res.xfer_id].state
        elapsed = time.perf_counter() - t0
        gate.open.set()
        for _ in range(100):  # then the pull's ordinary polls go on
            last = (await mover.poll([res.xfer_id]))[res.xfer_id].state
            if last is not XferState.PENDING:
                break
        await mover.release([res.xfer_id])
        return first, elapsed, last

    try:
        first, elapsed, last = asyncio.run(run())
    finally:
        mover.close()
    assert first is XferState.PENDING
    assert 0.015 <= elapsed < 1.0
    assert last is XferState.DONE and np.array_equal(dst, src)


def test_a_failed_copy_is_reported_at_once() -> None:
    gate = Gate(fail=True)
    mover = _mover(gate)
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros_like(src)

    async def run() -> tuple[XferState, str]:
        [res] = mover.post_now([_post(src, dst)])
        asyncio.get_running_loop().call_later(0.01, gate.open.set)
        st = (await mover.poll([res.xfer_id]))[res.xfer_id]
        await mover.release([res.xfer_id])
        return st.state, str(st.error)

    try:
        state, error = asyncio.run(run())
    finally:
        mover.close()
    assert state is XferState.FAILED and "copy went wrong" in error
    assert mover.copier.counts().handles == 0


def test_a_copy_released_before_it_ends_leaves_no_waiter_behind() -> None:
    gate = Gate()
    mover = _mover(gate)
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros_like(src)

    async def run() -> None:
        [res] = mover.post_now([_post(src, dst)])
        # released while running (a daemon stopping mid-copy): waits for the copy
        asyncio.get_running_loop().call_later(0.01, gate.open.set)
        await mover.release([res.xfer_id])

    asyncio.run(run())
    mover.close()
    assert mover.copier.counts().handles == 0
    deadline = time.monotonic() + 5
    while (any(t.name.startswith("kvd-copy-wait") for t in threading.enumerate())
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvd-copy-wait")]


def test_several_copies_of_one_pull_all_end_and_are_polled_done() -> None:
    gate = Gate()
    mover = _mover(gate)
    srcs = [np.full(4096, i + 1, dtype=np.uint8) for i in range(3)]
    dsts = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]

    async def run() -> dict:
        res = mover.post_now([_post(s, d) for s, d in zip(srcs, dsts, strict=True)])
        handles = [r.xfer_id for r in res]
        assert None not in handles
        asyncio.get_running_loop().call_later(0.01, gate.open.set)
        done: dict = {}
        for _ in range(100):
            states = await mover.poll(handles)
            done.update({h: s.state for h, s in states.items()
                         if s.state is not XferState.PENDING})
            handles = [h for h in handles if h not in done]
            if not handles:
                break
        await mover.release(list(done))
        return done

    try:
        done = asyncio.run(run())
    finally:
        mover.close()
    assert len(done) == 3 and all(s is XferState.DONE for s in done.values())
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts, strict=True))
    assert mover.copier.counts().handles == 0


def test_a_one_block_copy_ends_inside_post_on_the_daemons_copier() -> None:
    # 2 MiB: one block of a Llama-3-8B-like cache (16 tokens). Through the copy threads
    # it cost the pull 0.3-0.4 ms more than copied inline (kvd.daemon.pull.local).
    mover = LocalMover(localmod.local_copier(2))
    src = np.arange(2 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    big_src = np.ones(8 << 20, dtype=np.uint8)
    big_dst = np.zeros_like(big_src)
    try:
        [small] = mover.post_now([_post(src, dst)])
        assert small.done and small.xfer_id is None and small.error is None
        assert np.array_equal(dst, src)
        [big] = mover.post_now([_post(big_src, big_dst)])  # larger: on the copy threads
        assert big.xfer_id is not None
        assert mover.copier.wait(big.xfer_id, 10)
        asyncio.run(mover.release([big.xfer_id]))
        assert np.array_equal(big_dst, big_src)
    finally:
        mover.close()

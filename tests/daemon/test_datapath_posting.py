"""DataPath's posting hop: prepared lists when a post names its pools, and a READ done
at post needs no further hop (released at once, no handle left to poll or release)."""

from __future__ import annotations

import asyncio

import numpy as np

from kvd.daemon.datapath import DataPath
from kvd.transport.base import PoolSpan, ReadPost
from kvd.transport.loopback import LoopbackTransport

KiB = 1024


async def loopback_peer(nbytes: int) -> tuple[DataPath, LoopbackTransport, np.ndarray,
                                              np.ndarray, str]:
    """A DataPath over loopback with a registered destination, and a peer's source
    buffer loaded: (data path, peer transport, source, destination, peer name)."""
    a, b = LoopbackTransport(), LoopbackTransport()
    src = np.arange(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    dp = DataPath(a)
    await dp.register(int(dst.ctypes.data), dst.nbytes, "DRAM", 0)
    b.register(int(src.ctypes.data), src.nbytes, "DRAM", 0)
    return dp, b, src, dst, await dp.load_peer(b.metadata(), "b")


def test_posts_through_prepared_lists_and_releases_done_reads() -> None:
    async def run() -> None:
        dp, b, src, dst, peer = await loopback_peer(64 * KiB)
        offs = np.array([0, 8 * KiB, 16 * KiB], dtype=np.int64)  # adjacent: they merge
        post = ReadPost(peer=peer, local_addrs=int(dst.ctypes.data) + offs,
                        remote_addrs=int(src.ctypes.data) + offs,
                        nbytes=np.full(3, 8 * KiB, dtype=np.int64), mem_type="DRAM",
                        notif=b"n", local_pools=(PoolSpan(int(dst.ctypes.data), dst.nbytes),),
                        remote_pools=(PoolSpan(int(src.ctypes.data), src.nbytes),))
        [res] = await dp.post_reads([post])
        assert res.error is None and res.done and res.xfer_id is None
        assert res.timing is not None and res.timing.descriptors >= 1
        assert dp._poster.prepped_posts == 1 and dp._poster.fresh_posts == 0
        assert (dst[:24 * KiB] == src[:24 * KiB]).all() and not dst[24 * KiB:].any()
        counts = await dp.counts()
        assert counts.transfers == 0 and dp.inflight(peer) == 0
        [again] = await dp.post_reads([post])  # the same lists, no new preparation
        assert again.done and (await dp.counts()).prepared_lists == 2
        await dp.close()
        assert dp.transport.counts().prepared_lists == 0
        b.close()

    asyncio.run(run())


def test_a_first_read_to_a_peer_is_posted_off_the_event_loop() -> None:
    """A first READ may wait on the connection to its peer inside transfer(): it goes to
    the NIXL thread (a hybrid whole-engine pull once froze a daemon's loop for 30 s);
    later small READs to that peer run inline, and a reloaded peer starts over."""
    async def run() -> None:
        dp, b, src, dst, peer = await loopback_peer(16 * KiB)
        post = ReadPost(peer=peer, local_addrs=np.array([int(dst.ctypes.data)], np.int64),
                        remote_addrs=np.array([int(src.ctypes.data)], np.int64),
                        nbytes=np.array([4 * KiB], np.int64), mem_type="DRAM", notif=b"")
        assert dp.post_reads_now([post]) is None, "a first READ must not run on the loop"
        threads = dp.thread_calls
        [first] = await dp.post_reads([post])
        assert first.done and dp.thread_calls == threads + 1
        [again] = dp.post_reads_now([post]) or [None]
        assert again is not None and again.done, "later small READs run inline"
        assert (dst[:4 * KiB] == src[:4 * KiB]).all()
        await dp.forget_peer(peer)
        peer = await dp.load_peer(b.metadata(), "b")
        assert dp.post_reads_now([post]) is None, "a reloaded peer connects anew"
        await dp.close()
        b.close()

    asyncio.run(run())


def test_reads_to_a_peer_whose_read_failed_go_off_the_event_loop_again() -> None:
    """A failed READ may mean a dead, frozen or unreachable peer, whose UCX endpoint a
    post could wait on: later READs to it are posted on the NIXL thread until one
    succeeds again, whether the failure came at post or at a poll."""
    async def run() -> None:
        dp, b, src, dst, peer = await loopback_peer(16 * KiB)
        post = ReadPost(peer=peer, local_addrs=np.array([int(dst.ctypes.data)], np.int64),
                        remote_addrs=np.array([int(src.ctypes.data)], np.int64),
                        nbytes=np.array([4 * KiB], np.int64), mem_type="DRAM", notif=b"")
        [first] = await dp.post_reads([post])
        assert first.done and dp.post_reads_now([post]) is not None  # inline from now on
        dp.transport.fail_next_reads = 1  # fails at the post's own poll
        [failed] = dp.post_reads_now([post]) or [None]
        assert failed is not None and failed.error is not None
        assert dp.post_reads_now([post]) is None, "a failed peer's READ ran on the loop"
        threads = dp.thread_calls
        await dp.send_notif(peer, b"n")
        assert dp.thread_calls == threads + 1, "a notification to it ran on the loop"
        [ok] = await dp.post_reads([post])
        assert ok.done and dp.post_reads_now([post]) is not None, "inline again once it works"

        dp.transport.hold_reads = True  # pending at post: the failure comes at a poll
        [held] = dp.post_reads_now([post]) or [None]
        assert held is not None and held.xfer_id is not None
        dp.transport._xfers[held.xfer_id] = False  # it fails while in flight
        states = await dp.poll_many([held.xfer_id])
        assert states[held.xfer_id].error is not None
        assert dp.post_reads_now([post]) is None, "a failed peer's READ ran on the loop"
        dp.transport.hold_reads = False
        await dp.release([held.xfer_id])
        await dp.close()
        b.close()

    asyncio.run(run())

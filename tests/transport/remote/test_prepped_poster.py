"""PoolGrid arithmetic and PreppedPoster's choices (loopback: logic and bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.transport.base import ReadPost
from kvd.transport.loopback import LoopbackTransport
from kvd.transport.remote.prepped import PoolGrid, PoolSpan, PreppedPoster, common_chunk

KiB = 1024


def test_grid_rows_and_indices_across_pools() -> None:
    grid = PoolGrid((PoolSpan(100_000, 8 * KiB), PoolSpan(10_000, 4 * KiB + 5)), 1 * KiB)
    rows = grid.rows()
    assert rows.addrs.tolist() == [10_000, 100_000]  # sorted by base, tail bytes dropped
    assert rows.counts.tolist() == [4, 8]
    assert grid.indices(np.array([10_000 + 2 * KiB, 100_000]), np.array([KiB, 3 * KiB])
                        ).tolist() == [2, 4, 5, 6]
    assert grid.indices(np.array([10_000 + 1]), np.array([KiB])) is None  # misaligned
    assert grid.indices(np.array([10_000 + 3 * KiB]), np.array([2 * KiB])) is None  # past end
    assert grid.indices(np.array([5]), np.array([KiB])) is None  # below every pool
    assert grid.indices(np.array([10_000]), np.array([KiB])).dtype == np.int32


def test_common_chunk() -> None:
    assert common_chunk(np.array([32 * KiB, 64 * KiB]), np.array([0, 96 * KiB])) == 32 * KiB
    assert common_chunk(np.array([32 * KiB]), np.array([16 * KiB]), np.array([0])) == 16 * KiB


@pytest.fixture
def setup():
    a, b = LoopbackTransport(), LoopbackTransport()
    rng = np.random.default_rng(3)
    srcs = [rng.integers(0, 256, 64 * KiB, dtype=np.uint8) for _ in range(2)]
    dsts = [np.zeros(64 * KiB, dtype=np.uint8) for _ in range(2)]
    regs = [a.register(int(d.ctypes.data), d.nbytes, "DRAM", 0) for d in dsts]
    for s in srcs:
        b.register(int(s.ctypes.data), s.nbytes, "DRAM", 0)
    peer = a.add_peer(b.metadata())
    poster = PreppedPoster(a)
    yield a, b, peer, poster, srcs, dsts, regs
    poster.close()
    assert a.counts().prepared_lists == 0
    a.close()
    b.close()


def _spans(bufs: list[np.ndarray]) -> tuple[PoolSpan, ...]:
    return tuple(PoolSpan(int(x.ctypes.data), x.nbytes) for x in bufs)


def _post(peer: str, dsts: list[np.ndarray], srcs: list[np.ndarray], dst: int, src: int,
          pairs: list[tuple[int, int, int]], pools: bool = True) -> ReadPost:
    """pairs: (local offset, remote offset, bytes) into dsts[dst] <- srcs[src]."""
    lo, ro, nb = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
    return ReadPost(peer=peer, local_addrs=int(dsts[dst].ctypes.data) + lo,
                    remote_addrs=int(srcs[src].ctypes.data) + ro, nbytes=nb, mem_type="DRAM",
                    notif=b"n", local_pools=_spans(dsts) if pools else (),
                    remote_pools=_spans(srcs) if pools else ())


def test_posts_through_prepared_lists_byte_exact_and_merged(setup) -> None:
    a, b, peer, poster, srcs, dsts, _ = setup
    # Two 8 KiB descriptors adjacent on both sides, and one 16 KiB elsewhere (chunk 8 KiB).
    post = _post(peer, dsts, srcs, 1, 0, [(0, 8 * KiB, 8 * KiB), (8 * KiB, 16 * KiB, 8 * KiB),
                                          (32 * KiB, 48 * KiB, 16 * KiB)])
    xfer, done = poster.post(post)
    assert done and poster.prepped_posts == 1 and poster.fresh_posts == 0
    assert a.xfer_descriptors(xfer) == 2  # the first two merged; the 16 KiB one is 2 chunks
    assert np.array_equal(dsts[1][:16 * KiB], srcs[0][8 * KiB:24 * KiB])
    assert np.array_equal(dsts[1][32 * KiB:48 * KiB], srcs[0][48 * KiB:])
    assert not dsts[0].any()
    assert b.notifications() == [(a.name, b"n")]
    assert a.counts().prepared_lists == 2
    poster.post(post)  # same chunk, same pools: the lists are reused
    assert a.counts().prepared_lists == 2 and poster.lists() == 1


def test_prepare_makes_the_lists_a_later_post_of_the_same_chunk_uses(setup) -> None:
    """A warm-up's sample READ (kvd.daemon.pull.consumer.warm_pair): its lists prepared,
    nothing posted; a later READ of other blocks at the same chunk only picks indices."""
    a, b, peer, poster, srcs, dsts, _ = setup
    sample = _post(peer, dsts, srcs, 0, 0, [(8 * KiB, 8 * KiB, 8 * KiB),
                                           (24 * KiB, 48 * KiB, 8 * KiB)])
    assert poster.prepare(sample)
    assert a.counts().prepared_lists == 2 and a.counts().transfers == 0
    assert not dsts[0].any() and b.notifications() == []  # nothing read
    assert poster.prepped_posts == poster.fresh_posts == 0
    xfer, done = poster.post(_post(peer, dsts, srcs, 1, 1, [(16 * KiB, 0, 8 * KiB),
                                                          (40 * KiB, 24 * KiB, 16 * KiB)]))
    assert done and poster.prepped_posts == 1
    assert a.counts().prepared_lists == 2  # the sample's: none of its own
    assert np.array_equal(dsts[1][40 * KiB:56 * KiB], srcs[1][24 * KiB:40 * KiB])
    assert not poster.prepare(_post(peer, dsts, srcs, 0, 0, [(0, 0, 4 * KiB)], pools=False))
    assert a.counts().prepared_lists == 2


def test_falls_back_without_pools_outside_them_or_too_fine(setup) -> None:
    a, _, peer, poster, srcs, dsts, _ = setup
    poster.post(_post(peer, dsts, srcs, 0, 0, [(0, 0, 4 * KiB)], pools=False))
    assert poster.fresh_posts == 1
    scratch = np.zeros(4 * KiB, dtype=np.uint8)  # registered, but not in the post's pools
    a.register(int(scratch.ctypes.data), scratch.nbytes, "DRAM", 0)
    outside = ReadPost(peer=peer, local_addrs=np.array([int(scratch.ctypes.data)]),
                       remote_addrs=np.array([int(srcs[0].ctypes.data)]),
                       nbytes=np.array([4 * KiB]), mem_type="DRAM", notif=b"",
                       local_pools=_spans(dsts), remote_pools=_spans(srcs))
    poster.post(outside)
    assert poster.fresh_posts == 2
    assert np.array_equal(scratch, srcs[0][:4 * KiB])
    fine = _post(peer, dsts, srcs, 0, 0, [(0, 3, 16 * KiB)])  # gcd 1: 16,384 indices
    poster.post(fine)
    assert poster.fresh_posts == 3 and poster.prepped_posts == 0
    assert np.array_equal(dsts[0][:16 * KiB], srcs[0][3:3 + 16 * KiB])


def test_lists_released_under_it_are_prepared_again(setup) -> None:
    a, b, peer, poster, srcs, dsts, regs = setup
    poster.post(_post(peer, dsts, srcs, 0, 0, [(0, 0, 4 * KiB)]))
    a.remove_peer(peer)  # the transport releases the peer's lists (a reload)
    a.add_peer(b.metadata())
    dsts[0][:] = 0
    poster.post(_post(peer, dsts, srcs, 0, 1, [(0, 0, 4 * KiB)]))
    assert poster.prepped_posts == 2 and poster.lists() == 1
    assert np.array_equal(dsts[0][:4 * KiB], srcs[1][:4 * KiB])
    a.deregister(regs[1])  # the local list covered it: released
    regs[1] = a.register(int(dsts[1].ctypes.data), dsts[1].nbytes, "DRAM", 0)
    poster.post(_post(peer, dsts, srcs, 1, 1, [(0, 0, 4 * KiB)]))
    assert poster.prepped_posts == 3 and a.counts().prepared_lists == 2


def test_pool_sets_and_chunks_get_their_own_lists_bounded(setup) -> None:
    a, _, peer, poster, srcs, dsts, _ = setup
    poster.max_lists = 3
    for k in range(5):
        poster.post(_post(peer, dsts, srcs, 0, 0, [(0, 0, (2 ** k) * KiB)]))
    assert poster.lists() == 3 and a.counts().prepared_lists == 6
    one_pool = ReadPost(peer=peer, local_addrs=np.array([int(dsts[0].ctypes.data)]),
                        remote_addrs=np.array([int(srcs[0].ctypes.data)]),
                        nbytes=np.array([16 * KiB]), mem_type="DRAM", notif=b"",
                        local_pools=_spans(dsts[:1]), remote_pools=_spans(srcs))
    poster.post(one_pool)  # same chunk as before, other pools: other lists
    assert poster.lists() == 3 and poster.prepped_posts == 6
    poster.forget_peer(peer)
    assert poster.lists() == 0 and a.counts().prepared_lists == 0


def test_each_side_is_prepared_in_its_own_memory_type(setup) -> None:
    """A DRAM engine of a GPU node's daemon reading a VRAM pool elsewhere: the local list
    is DRAM, the remote one VRAM (one type for both would make NIXL refuse the READ)."""
    a, _, peer, poster, srcs, dsts, _ = setup
    seen: list[tuple[str, str]] = []
    real_local, real_remote = a.prepare_local, a.prepare_remote

    def local(rows):
        seen.append(("local", rows.mem_type))
        return real_local(rows)

    def remote(p, rows):
        seen.append(("remote", rows.mem_type))
        return real_remote(p, rows)

    a.prepare_local, a.prepare_remote = local, remote
    post = _post(peer, dsts, srcs, 0, 0, [(0, 0, 8 * KiB)])
    mixed = ReadPost(peer=post.peer, local_addrs=post.local_addrs,
                     remote_addrs=post.remote_addrs, nbytes=post.nbytes, mem_type="VRAM",
                     notif=b"", local_pools=post.local_pools, remote_pools=post.remote_pools,
                     local_mem_type="DRAM")
    poster.post(mixed)
    assert seen == [("local", "DRAM"), ("remote", "VRAM")]
    assert np.array_equal(dsts[0][:8 * KiB], srcs[0][:8 * KiB])
    poster.post(post)  # the same pools with one memory type: lists of their own
    assert poster.lists() == 2

"""PoolGrid arithmetic and PreppedPoster's choices (loopback: logic and bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.transport.base import ReadPost
from kvd.transport.loopback import LoopbackTransport
from kvd.transport.prepped import PoolGrid, PoolSpan, PreppedPoster, common_chunk

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
    for d in dsts:
        a.register(int(d.ctypes.data), d.nbytes, "DRAM", 0)
    for s in srcs:
        b.register(int(s.ctypes.data), s.nbytes, "DRAM", 0)
    peer = a.add_peer(b.metadata())
    poster = PreppedPoster(a)
    poster.set_local_pools([PoolSpan(int(d.ctypes.data), d.nbytes) for d in dsts])
    poster.set_remote_pools(peer, [PoolSpan(int(s.ctypes.data), s.nbytes) for s in srcs])
    yield a, b, peer, poster, srcs, dsts
    poster.close()
    assert a.counts().prepared_lists == 0
    a.close()
    b.close()


def _post(peer: str, dst: np.ndarray, src: np.ndarray, pairs: list[tuple[int, int, int]]
          ) -> ReadPost:
    """pairs: (local offset, remote offset, bytes)."""
    lo, ro, nb = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
    return ReadPost(peer=peer, local_addrs=int(dst.ctypes.data) + lo,
                    remote_addrs=int(src.ctypes.data) + ro, nbytes=nb, mem_type="DRAM",
                    notif=b"n")


def test_posts_through_prepared_lists_byte_exact_and_merged(setup) -> None:
    a, _, peer, poster, srcs, dsts = setup
    # Two 8 KiB descriptors adjacent on both sides, and one 16 KiB elsewhere (chunk 8 KiB).
    post = _post(peer, dsts[1], srcs[0], [(0, 8 * KiB, 8 * KiB), (8 * KiB, 16 * KiB, 8 * KiB),
                                          (32 * KiB, 48 * KiB, 16 * KiB)])
    xfer, done = poster.post(post)
    assert done and poster.prepped_posts == 1 and poster.fresh_posts == 0
    assert a.xfer_descriptors(xfer) == 2  # the first two merged; the 16 KiB one is 2 chunks
    assert np.array_equal(dsts[1][:16 * KiB], srcs[0][8 * KiB:24 * KiB])
    assert np.array_equal(dsts[1][32 * KiB:48 * KiB], srcs[0][48 * KiB:])
    assert not dsts[0].any()
    assert a.counts().prepared_lists == 2
    poster.post(post)  # same chunk: the lists are reused
    assert a.counts().prepared_lists == 2


def test_falls_back_for_descriptors_outside_pools_or_too_fine(setup) -> None:
    a, _, peer, poster, srcs, dsts = setup
    scratch = np.zeros(4 * KiB, dtype=np.uint8)  # registered, but not a pool it was told of
    a.register(int(scratch.ctypes.data), scratch.nbytes, "DRAM", 0)
    outside = ReadPost(peer=peer, local_addrs=np.array([int(scratch.ctypes.data)]),
                       remote_addrs=np.array([int(srcs[0].ctypes.data)]),
                       nbytes=np.array([4 * KiB]), mem_type="DRAM", notif=b"")
    poster.post(outside)
    assert poster.fresh_posts == 1
    assert np.array_equal(scratch, srcs[0][:4 * KiB])
    fine = _post(peer, dsts[0], srcs[0], [(0, 3, 16 * KiB)])  # gcd 1: 16,384 indices
    poster.post(fine)
    assert poster.fresh_posts == 2 and poster.prepped_posts == 0
    assert np.array_equal(dsts[0][:16 * KiB], srcs[0][3:3 + 16 * KiB])


def test_pool_changes_and_peer_loss_drop_lists(setup) -> None:
    a, _, peer, poster, srcs, dsts = setup
    poster.post(_post(peer, dsts[0], srcs[0], [(0, 0, 4 * KiB)]))
    poster.post(_post(peer, dsts[0], srcs[0], [(0, 0, 8 * KiB)]))  # a second chunk size
    assert a.counts().prepared_lists == 4
    poster.set_remote_pools(peer, [PoolSpan(int(srcs[0].ctypes.data), srcs[0].nbytes)])
    assert a.counts().prepared_lists == 0
    poster.post(_post(peer, dsts[0], srcs[0], [(0, 0, 4 * KiB)]))
    poster.set_local_pools([PoolSpan(int(dsts[0].ctypes.data), dsts[0].nbytes)])
    assert a.counts().prepared_lists == 0
    poster.post(_post(peer, dsts[0], srcs[0], [(0, 0, 4 * KiB)]))
    poster.forget_peer(peer)
    assert a.counts().prepared_lists == 0
    poster.post(_post(peer, dsts[0], srcs[0], [(0, 0, 4 * KiB)]))  # unknown peer: fresh
    assert poster.fresh_posts == 1


def test_keeps_a_bounded_number_of_chunk_sizes(setup) -> None:
    a, _, peer, poster, srcs, dsts = setup
    for k in range(6):
        poster.post(_post(peer, dsts[0], srcs[0], [(0, 0, (2 ** k) * KiB)]))
    assert a.counts().prepared_lists == 2 * poster.max_chunks_per_peer

"""Prepared lists on the loopback transport (the daemon's unit-test stand-in for NIXL):
same checks as NIXL's make_prepped_xfer, same bytes, same merge count; DescRows itself."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import TransferError
from kvd.transport.base import DescRows, PreppedRead, merged_count
from kvd.transport.loopback import LoopbackTransport

CHUNK = 256
N = 64


@pytest.fixture
def pair():
    a, b = LoopbackTransport(), LoopbackTransport()
    src = np.random.default_rng(0).integers(0, 256, CHUNK * N, dtype=np.uint8)
    dst = np.zeros(CHUNK * N, dtype=np.uint8)
    a.register(int(dst.ctypes.data), dst.nbytes, "DRAM", 0)
    b.register(int(src.ctypes.data), src.nbytes, "DRAM", 0)
    peer = a.add_peer(b.metadata())
    local = a.prepare_local(DescRows.grid(int(dst.ctypes.data), CHUNK, N))
    remote = a.prepare_remote(peer, DescRows.grid(int(src.ctypes.data), CHUNK, N))
    yield a, b, peer, local, remote, src, dst
    a.close()
    b.close()


def _i32(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int32)


def test_copies_the_indexed_chunks_and_notifies(pair) -> None:
    a, b, peer, local, remote, src, dst = pair
    xfer, done = a.post_prepped_read(PreppedRead(peer, local, remote, _i32(5, 0, 9),
                                                 _i32(1, 63, 9), b"hello"))
    assert done and a.poll(xfer)
    for li, ri in ((5, 1), (0, 63), (9, 9)):
        assert np.array_equal(dst[li * CHUNK:(li + 1) * CHUNK], src[ri * CHUNK:(ri + 1) * CHUNK])
    assert not dst[CHUNK:5 * CHUNK].any()
    assert b.notifications() == [(a.name, b"hello")]
    assert a.xfer_descriptors(xfer) == 3
    assert a.last_post is not None and a.last_post.descriptors == 3
    a.release(xfer)
    assert a.counts().transfers == 0


def test_merge_count_like_nixl(pair) -> None:
    a, _, peer, local, remote, _, _ = pair
    run = np.arange(10, 30, dtype=np.int32)
    xfer, _ = a.post_prepped_read(PreppedRead(peer, local, remote, run, run - 10, b""))
    assert a.xfer_descriptors(xfer) == 1
    xfer2, _ = a.post_prepped_read(PreppedRead(peer, local, remote, _i32(0, 2, 4), _i32(0, 1, 2),
                                               b""))
    assert a.xfer_descriptors(xfer2) == 3  # adjacent on one side only: no merge


def test_rejects_what_nixl_rejects(pair) -> None:
    a, _, peer, local, remote, src, _ = pair
    wide = a.prepare_remote(peer, DescRows.grid(int(src.ctypes.data), 2 * CHUNK, N // 2))
    bad = [
        PreppedRead(peer, local, remote, _i32(N), _i32(0), b""),
        PreppedRead(peer, local, remote, _i32(-1), _i32(0), b""),
        PreppedRead(peer, local, remote, _i32(0, 1), _i32(0), b""),
        PreppedRead(peer, local, remote, _i32(), _i32(), b""),
        PreppedRead(peer, local, wide, _i32(0), _i32(0), b""),
        PreppedRead(peer, remote, remote, _i32(0), _i32(0), b""),
        PreppedRead(peer, local, 12345, _i32(0), _i32(0), b""),
    ]
    for post in bad:
        with pytest.raises(TransferError):
            a.post_prepped_read(post)
    assert a.counts().transfers == 0
    with pytest.raises(TransferError):
        a.prepare_remote(peer, DescRows.grid(int(src.ctypes.data), CHUNK, N + 1))
    with pytest.raises(TransferError, match="not loaded"):
        a.prepare_remote("nobody", DescRows.grid(int(src.ctypes.data), CHUNK, 1))


def test_peer_removal_and_deregistration_release_lists(pair) -> None:
    a, b, peer, local, remote, src, _ = pair
    extra = np.zeros(CHUNK, dtype=np.uint8)
    reg = a.register(int(extra.ctypes.data), CHUNK, "DRAM", 0)
    a.prepare_local(DescRows.grid(int(extra.ctypes.data), CHUNK, 1))
    assert a.counts().prepared_lists == 3
    a.deregister(reg)
    assert a.counts().prepared_lists == 2
    a.remove_peer(peer)
    assert a.counts().prepared_lists == 1
    with pytest.raises(TransferError, match="reloaded"):
        a.post_prepped_read(PreppedRead(peer, local, remote, _i32(0), _i32(0), b""))
    a.release_prepared(local)
    a.release_prepared(local)  # twice: ignored
    assert a.counts().prepared_lists == 0


def test_failure_injection_and_held_reads_apply(pair) -> None:
    a, _, peer, local, remote, src, dst = pair
    a.fail_next_reads = 1
    xfer, done = a.post_prepped_read(PreppedRead(peer, local, remote, _i32(0), _i32(1), b""))
    assert not done
    with pytest.raises(TransferError):
        a.poll(xfer)
    a.release(xfer)
    a.hold_reads = True
    xfer, done = a.post_prepped_read(PreppedRead(peer, local, remote, _i32(0), _i32(1), b""))
    assert not done and not a.poll(xfer) and not dst.any()
    a.hold_reads = False
    assert a.poll(xfer)
    assert np.array_equal(dst[:CHUNK], src[CHUNK:2 * CHUNK])


def test_desc_rows_expand_in_index_order() -> None:
    rows = DescRows(addrs=np.array([1000, 5000]), nbytes=np.array([10, 20]),
                    strides=np.array([100, 20]), counts=np.array([3, 2]))
    addrs, nbytes, devs = rows.expand()
    assert addrs.tolist() == [1000, 1100, 1200, 5000, 5020]
    assert nbytes.tolist() == [10, 10, 10, 20, 20]
    assert devs.tolist() == [0] * 5
    assert len(rows) == 5
    assert rows.extent() == (1000, 5040)
    assert rows.nixl_rows().tolist() == [[1000, 10, 0, 100, 3], [5000, 20, 0, 20, 2]]
    one = DescRows.of_descriptors(np.array([7, 3]), np.array([1, 2]), devs=np.array([1, 2]))
    assert one.expand()[0].tolist() == [7, 3] and one.nixl_rows()[:, 2].tolist() == [1, 2]


@pytest.mark.parametrize("kwargs", [
    {"addrs": [0, 1], "nbytes": [1], "strides": [1], "counts": [1]},
    {"addrs": [], "nbytes": [], "strides": [], "counts": []},
    {"addrs": [0], "nbytes": [0], "strides": [1], "counts": [1]},
    {"addrs": [0], "nbytes": [1], "strides": [1], "counts": [0]},
    {"addrs": [-1], "nbytes": [1], "strides": [1], "counts": [1]},
    {"addrs": [0], "nbytes": [1], "strides": [1], "counts": [2**31]},
])
def test_desc_rows_refuses_nonsense(kwargs) -> None:
    with pytest.raises(ValueError):
        DescRows(**{k: np.array(v, dtype=np.int64) for k, v in kwargs.items()})


def test_merged_count() -> None:
    assert merged_count(np.array([]), np.array([]), np.array([])) == 0
    assert merged_count(np.array([0, 10, 20]), np.array([50, 60, 70]), np.array([10] * 3)) == 1
    assert merged_count(np.array([0, 10, 30]), np.array([50, 60, 70]), np.array([10] * 3)) == 2

"""Prepared descriptor lists through real NIXL between two processes: bytes, merging, errors.

One spawned target owns a patterned 8 MiB buffer; this process reads from it with
`NixlTransport` (telemetry on, to see how many descriptors NIXL posted after merging).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvd.errors import TransferError
from kvd.transport.base import DescRows, PreppedRead, ReadPost
from kvd.transport.remote.nixl import NixlTransport
from tests.support.nixl_peer import pattern, serve

pytestmark = pytest.mark.nixl

NBYTES = 8 << 20
CHUNK = 4096
NCHUNKS = NBYTES // CHUNK


@dataclass
class Peer:
    transport: NixlTransport
    name: str
    remote_addr: int
    conn: Any
    local: np.ndarray
    meta: bytes


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, NBYTES), daemon=True)
    proc.start()
    transport = None
    try:
        assert parent.poll(60), "target did not start"
        meta, remote_addr = parent.recv()
        transport = NixlTransport(name="test-initiator", telemetry=True)
        local = np.zeros(NBYTES, dtype=np.uint8)
        transport.register(int(local.ctypes.data), NBYTES, "DRAM", 0)
        name = transport.add_peer(meta)
        yield Peer(transport, name, remote_addr, parent, local, meta)
    finally:
        if transport is not None:
            transport.close()
            assert transport.counts().prepared_lists == 0
        parent.send("stop")
        parent.poll(10)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _wait(transport: NixlTransport, xfer_id: int, done: bool) -> None:
    deadline = time.monotonic() + 10
    while not done:
        assert time.monotonic() < deadline, "READ did not finish"
        done = transport.poll(xfer_id)


def _lists(p: Peer, chunk: int = CHUNK) -> tuple[int, int]:
    t = p.transport
    local = t.prepare_local(DescRows.grid(int(p.local.ctypes.data), chunk, NBYTES // chunk))
    remote = t.prepare_remote(p.name, DescRows.grid(p.remote_addr, chunk, NBYTES // chunk))
    return local, remote


def _read(p: Peer, local: int, remote: int, li: np.ndarray, ri: np.ndarray,
          notif: bytes = b"n") -> int:
    """Posts, waits, returns NIXL's descriptor count after merging; handle released."""
    t = p.transport
    xfer_id, done = t.post_prepped_read(PreppedRead(p.name, local, remote, li.astype(np.int32),
                                                    ri.astype(np.int32), notif))
    _wait(t, xfer_id, done)
    merged = t.xfer_descriptors(xfer_id)
    t.release(xfer_id)
    assert merged is not None
    return merged


def _chunks(buf: np.ndarray, idx: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    return buf.reshape(-1, chunk)[idx]


def test_random_indices_byte_exact_and_notified(peer: Peer) -> None:
    peer.local[:] = 0
    local, remote = _lists(peer)
    rng = np.random.default_rng(5)
    li = rng.choice(NCHUNKS, 500, replace=False)
    ri = rng.choice(NCHUNKS, 500, replace=False)
    _read(peer, local, remote, li, ri, b"random-500")
    src = pattern(NBYTES)
    assert np.array_equal(_chunks(peer.local, li), _chunks(src, ri))
    untouched = np.setdiff1d(np.arange(NCHUNKS), li)
    assert not _chunks(peer.local, untouched).any(), "bytes outside the READ were written"
    deadline = time.monotonic() + 5
    while True:
        peer.conn.send("notifs")
        if b"random-500" in peer.conn.recv():
            break
        assert time.monotonic() < deadline, "target never got the notification"
        time.sleep(0.01)
    peer.transport.release_prepared(local)
    peer.transport.release_prepared(remote)


def test_adjacent_indices_merge_in_nixl(peer: Peer) -> None:
    peer.local[:] = 0
    local, remote = _lists(peer)
    src = pattern(NBYTES)
    run = np.arange(100, 356)  # 256 consecutive chunks on both sides: one descriptor
    assert _read(peer, local, remote, run, run + 7) == 1
    assert np.array_equal(_chunks(peer.local, run), _chunks(src, run + 7))
    every_other = np.arange(0, 512, 2)
    assert _read(peer, local, remote, every_other, every_other) == 256
    two_runs = np.concatenate([np.arange(1000, 1010), np.arange(1500, 1510)])
    assert _read(peer, local, remote, two_runs, two_runs + 1) == 2
    assert np.array_equal(_chunks(peer.local, two_runs), _chunks(src, two_runs + 1))
    peer.transport.release_prepared(local)
    peer.transport.release_prepared(remote)


def test_strided_rows_with_gaps(peer: Peer) -> None:
    """Head slices: the first 1 KiB of every 4 KiB chunk, as one strided row per side."""
    peer.local[:] = 0
    t = peer.transport
    local = t.prepare_local(DescRows.grid(int(peer.local.ctypes.data), 1024, NCHUNKS,
                                          stride_nbytes=CHUNK))
    remote = t.prepare_remote(peer.name, DescRows.grid(peer.remote_addr, 1024, NCHUNKS,
                                                       stride_nbytes=CHUNK))
    idx = np.arange(10, 20)
    assert _read(peer, local, remote, idx, idx + 3) == 10, "gapped slices must not merge"
    src = pattern(NBYTES).reshape(-1, CHUNK)
    got = peer.local.reshape(-1, CHUNK)
    assert np.array_equal(got[idx, :1024], src[idx + 3, :1024])
    assert not got[idx, 1024:].any()
    t.release_prepared(local)
    t.release_prepared(remote)


def test_rejects_bad_posts(peer: Peer) -> None:
    t = peer.transport
    local, remote = _lists(peer)
    remote8k = t.prepare_remote(peer.name, DescRows.grid(peer.remote_addr, 8192, NCHUNKS // 2))
    one = np.array([0], dtype=np.int32)
    cases = {
        "out of range": PreppedRead(peer.name, local, remote, np.array([NCHUNKS], np.int32),
                                    one, b""),
        "lengths": PreppedRead(peer.name, local, remote, np.array([0, 1], np.int32), one, b""),
        "sizes": PreppedRead(peer.name, local, remote8k, one, one, b""),
        "local as remote": PreppedRead(peer.name, local, local, one, one, b""),
        "unknown list": PreppedRead(peer.name, local, 999_999, one, one, b""),
    }
    for what, post in cases.items():
        with pytest.raises(TransferError):
            t.post_prepped_read(post)
        assert t.counts().transfers == 0, what
    with pytest.raises(TransferError):  # beyond the peer's registered memory
        t.prepare_remote(peer.name, DescRows.grid(peer.remote_addr, CHUNK, NCHUNKS + 1))
    with pytest.raises(TransferError):
        t.prepare_local(DescRows.grid(int(peer.local.ctypes.data) + CHUNK, CHUNK, NCHUNKS))
    for list_id in (local, remote, remote8k):
        t.release_prepared(list_id)


def test_fresh_descriptor_path_still_works(peer: Peer) -> None:
    peer.local[:] = 0
    t = peer.transport
    base = int(peer.local.ctypes.data)
    li, ri = np.array([3, 9]), np.array([40, 2])
    post = ReadPost(peer=peer.name, local_addrs=base + li * CHUNK,
                    remote_addrs=peer.remote_addr + ri * CHUNK,
                    nbytes=np.full(2, CHUNK), mem_type="DRAM", notif=b"old")
    xfer_id, done = t.post_read(post)
    _wait(t, xfer_id, done)
    t.release(xfer_id)
    assert np.array_equal(_chunks(peer.local, li), _chunks(pattern(NBYTES), ri))


def test_peer_reload_releases_its_lists_and_deregister_the_local_ones(peer: Peer) -> None:
    t = peer.transport
    local, remote = _lists(peer)
    scratch = np.zeros(1 << 20, dtype=np.uint8)
    reg = t.register(int(scratch.ctypes.data), scratch.nbytes, "DRAM", 0)
    over_scratch = t.prepare_local(DescRows.grid(int(scratch.ctypes.data), CHUNK, 256))
    before = t.counts().prepared_lists
    t.deregister(reg)
    assert t.counts().prepared_lists == before - 1
    assert over_scratch not in t._prepared
    t.remove_peer(peer.name)
    assert t.counts().prepared_lists == before - 2  # the peer's list went with it
    zero = np.zeros(1, np.int32)
    with pytest.raises(TransferError, match="reloaded"):
        t.post_prepped_read(PreppedRead(peer.name, local, remote, zero, zero, b""))
    with pytest.raises(TransferError, match="not loaded"):
        t.prepare_remote(peer.name, DescRows.grid(peer.remote_addr, CHUNK, 1))
    assert t.add_peer(peer.meta) == peer.name  # reloaded: prepare again and read
    remote = t.prepare_remote(peer.name, DescRows.grid(peer.remote_addr, CHUNK, NCHUNKS))
    peer.local[:] = 0
    _read(peer, local, remote, np.array([1]), np.array([2]))
    assert np.array_equal(_chunks(peer.local, np.array([1])), _chunks(pattern(NBYTES),
                                                                     np.array([2])))
    t.release_prepared(local)
    t.release_prepared(remote)


def test_poster_posts_readposts_through_prepared_lists(peer: Peer) -> None:
    """The daemon's wiring (PreppedPoster) through real NIXL: a ReadPost naming its pools
    goes through prepared lists, adjacent blocks merge, bytes land exactly."""
    from kvd.transport.base import PoolSpan
    from kvd.transport.remote.prepped import PreppedPoster

    peer.local[:] = 0
    t = peer.transport
    poster = PreppedPoster(t)
    base = int(peer.local.ctypes.data)
    li = np.array([10, 11, 12, 40, 41, 200])  # 32 KiB blocks: two runs and a single
    ri = np.array([5, 6, 7, 90, 91, 2])
    block = 32 * 1024
    post = ReadPost(peer=peer.name, local_addrs=base + li * block,
                    remote_addrs=peer.remote_addr + ri * block, nbytes=np.full(6, block),
                    mem_type="DRAM", notif=b"poster",
                    local_pools=(PoolSpan(base, NBYTES),),
                    remote_pools=(PoolSpan(peer.remote_addr, NBYTES),))
    xfer_id, done = poster.post(post)
    _wait(t, xfer_id, done)
    assert t.xfer_descriptors(xfer_id) == 3
    t.release(xfer_id)
    assert poster.prepped_posts == 1
    assert np.array_equal(_chunks(peer.local, li, block), _chunks(pattern(NBYTES), ri, block))
    poster.close()

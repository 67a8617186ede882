"""Splitting a READ by bytes (kvd.transport.remote.split): properties over any descriptor
pattern, and the split through posting workers, contiguous and fragmented, byte-exact
(loopback agents; the real-NIXL proof is tests/transport/remote/test_posting_workers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.transport.base import PoolSpan, ReadPost
from kvd.transport.loopback import LoopbackTransport
from kvd.transport.remote.split import RUN_CUT_SLACK, cut_grain, part_of, split_bytes
from kvd.transport.remote.workers import WorkerSet

MiB = 1 << 20


def _post(local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray) -> ReadPost:
    n = len(nbytes)
    return ReadPost(peer="p", local_addrs=np.asarray(local, dtype=np.int64),
                    remote_addrs=np.asarray(remote, dtype=np.int64),
                    nbytes=np.asarray(nbytes, dtype=np.int64), mem_type="DRAM", notif=b"",
                    local_devs=np.arange(n, dtype=np.int64) % 3,
                    remote_devs=np.arange(n, dtype=np.int64) % 5)


def _ranges(posts: list[ReadPost]) -> list[tuple[int, int, int, int, int]]:
    """(local, remote, nbytes, local dev, remote dev) of the posts' descriptors in order,
    neighbours adjacent on both sides (same devices) merged: equal lists mean the very
    same bytes are read into the very same places."""
    out: list[list[int]] = []
    for p in posts:
        for la, ra, n, ld, rd in zip(p.local_addrs.tolist(), p.remote_addrs.tolist(),
                                     p.nbytes.tolist(), p.local_devs.tolist(),
                                     p.remote_devs.tolist(), strict=True):
            assert n > 0, "empty descriptor in a part"
            if out and out[-1][0] + out[-1][2] == la and out[-1][1] + out[-1][2] == ra \
                    and out[-1][3:] == [ld, rd]:
                out[-1][2] += n
            else:
                out.append([la, ra, n, ld, rd])
    return [tuple(r) for r in out]


@st.composite
def reads(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors of a READ: sizes of pages or odd bytes, each adjacent to the previous
    one on both sides (a merged run), on one side only, or on neither."""
    unit = draw(st.sampled_from([1, 4096, 64 << 10, 2 * MiB]))
    n = draw(st.integers(1, 40))
    sizes = np.array(draw(st.lists(st.integers(1, 64), min_size=n, max_size=n)),
                     dtype=np.int64) * unit
    gaps = draw(st.lists(st.sampled_from(["run", "local", "remote", "both"]), min_size=n,
                         max_size=n))
    la, ra = [1 << 30], [5 << 30]
    for i in range(1, n):
        hole = draw(st.integers(1, 4)) * unit
        la.append(la[-1] + int(sizes[i - 1]) + (hole if gaps[i] in ("local", "both") else 0))
        ra.append(ra[-1] + int(sizes[i - 1]) + (hole if gaps[i] in ("remote", "both") else 0))
    return np.array(la, dtype=np.int64), np.array(ra, dtype=np.int64), sizes


@settings(max_examples=300, deadline=None)
@given(reads(), st.integers(1, 8), st.integers(0, 6), st.data())
def test_parts_cover_exactly_the_read_in_proportion(read, parts: int, min_shift: int,
                                                    data: st.DataObject) -> None:
    la, ra, nb = read
    total = int(nb.sum())
    min_part = max(1, data.draw(st.integers(1, max(1, total)), label="min_part") >> min_shift)
    cuts = split_bytes(la, ra, nb, parts, min_part)
    k = len(cuts) - 1
    assert cuts[0] == 0 and cuts[-1] == total
    assert all(a < b for a, b in zip(cuts, cuts[1:], strict=False)), cuts
    assert k == max(1, min(parts, total // min_part))
    post = _post(la, ra, nb)
    pieces = [part_of(post, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    # Both sides: the parts together are exactly the READ's byte ranges, in order.
    assert _ranges(pieces) == _ranges([post])
    sizes = [int(p.nbytes.sum()) for p in pieces]
    assert sizes == [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    if k > 1:  # no part below the threshold unless the whole READ is one part
        assert min(sizes) >= min_part, (sizes, min_part)
        share = total / k  # in proportion: each part within the cut slack of its share
        assert max(abs(s - share) for s in sizes) <= 2 * RUN_CUT_SLACK * share + 2, sizes


@settings(max_examples=200, deadline=None)
@given(reads(), st.integers(2, 8))
def test_cuts_inside_a_descriptor_keep_both_sides_on_the_grain(read, parts: int) -> None:
    la, ra, nb = read
    grain = cut_grain(la, ra, nb)
    total = int(nb.sum())
    cuts = split_bytes(la, ra, nb, parts)
    ends = set(np.cumsum(nb).tolist())
    post = _post(la, ra, nb)
    tolerance = RUN_CUT_SLACK * total / max(1, len(cuts) - 1)
    for c in cuts[1:-1]:
        if c in ends or tolerance < grain:
            continue
        p = part_of(post, c, total)
        assert p.local_addrs[0] % grain == 0 and p.remote_addrs[0] % grain == 0, (c, grain)


def test_one_contiguous_descriptor_is_cut_into_equal_byte_ranges() -> None:
    """The pull that moved all its bytes on one rail: 200 contiguous blocks that the
    planner merged into one descriptor of 100 MiB. Cut in 2 and 4 equal byte ranges."""
    base_l, base_r, n = 7 << 30, 3 << 30, 100 * MiB
    post = _post([base_l], [base_r], [n])
    for parts in (2, 4):
        cuts = split_bytes(post.local_addrs, post.remote_addrs, post.nbytes, parts, 4 * MiB)
        assert cuts == [n * p // parts for p in range(parts + 1)]
        pieces = [part_of(post, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert [int(p.local_addrs[0]) - base_l for p in pieces] == cuts[:-1]
        assert [int(p.remote_addrs[0]) - base_r for p in pieces] == cuts[:-1]
        assert [int(p.nbytes.sum()) for p in pieces] == [n // parts] * parts


def test_fragmented_reads_are_cut_between_runs_without_new_descriptors() -> None:
    """Four runs of uneven length: where a run boundary lies within the slack, the cut
    goes there and the parts hold exactly the READ's descriptors."""
    lens = [16, 17, 15, 16]
    local = np.concatenate([(s + np.arange(m)) * MiB for s, m in zip([0, 100, 200, 300], lens,
                                                                     strict=True)])
    # merged as the planner merges: one descriptor per run
    starts = np.cumsum([0, *lens[:-1]])
    la = local[starts]
    ra = la + (1 << 40)
    nb = np.array(lens, dtype=np.int64) * MiB
    cuts = split_bytes(la, ra, nb, 4, 4 * MiB)
    assert cuts == [0, 16 * MiB, 33 * MiB, 48 * MiB, 64 * MiB]
    post = _post(la, ra, nb)
    assert sum(len(part_of(post, a, b).nbytes)
               for a, b in zip(cuts, cuts[1:], strict=False)) == len(nb)


def test_small_reads_stay_whole() -> None:
    one = np.array([0])
    assert split_bytes(one, one, np.array([8 * MiB - 1]), 2, 4 * MiB) == [0, 8 * MiB - 1]
    assert split_bytes(one, one, np.array([8 * MiB]), 2, 4 * MiB) == [0, 4 * MiB, 8 * MiB]
    assert split_bytes(one, one, np.array([12 * MiB]), 4, 4 * MiB) == [0, 4 * MiB, 8 * MiB,
                                                                      12 * MiB]


# ------------------------------------------------------ through posting workers


@pytest.fixture
def three():
    src = np.random.default_rng(5).integers(0, 256, 96 * MiB, dtype=np.uint8)
    dst = np.zeros(96 * MiB, dtype=np.uint8)
    producer = LoopbackTransport()
    producer.register(int(src.ctypes.data), src.nbytes, "DRAM", 0)
    ws = WorkerSet([LoopbackTransport() for _ in range(3)])
    ws.register(int(dst.ctypes.data), dst.nbytes, "DRAM", 0)
    peer = ws.add_peer(producer.metadata())
    yield ws, peer, src, dst
    ws.close()
    producer.close()


def _runs_post(peer: str, src: np.ndarray, dst: np.ndarray, runs: list[tuple[int, int, int]]
               ) -> ReadPost:
    """(dst offset, src offset, bytes) per descriptor, pools named (prepared lists)."""
    d, s, n = (np.array(c, dtype=np.int64) for c in zip(*runs, strict=True))
    return ReadPost(peer=peer, local_addrs=int(dst.ctypes.data) + d,
                    remote_addrs=int(src.ctypes.data) + s, nbytes=n, mem_type="DRAM", notif=b"",
                    local_pools=(PoolSpan(int(dst.ctypes.data), dst.nbytes),),
                    remote_pools=(PoolSpan(int(src.ctypes.data), src.nbytes),))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 14), st.booleans()), min_size=1, max_size=12))
def test_any_pattern_is_spread_over_every_worker_byte_exact(three, blocks) -> None:
    """Runs of 512 KiB blocks, each run contiguous on both sides or not: whatever the
    pattern, a READ of N >= 3 x 4 MiB bytes gives each worker N/3 (within the slack),
    and every destination byte is the source's."""
    ws, peer, src, dst = three
    block = 512 << 10
    runs, d_off, s_off = [], 0, 0
    for length, gap in blocks:
        s_off += block if gap else 0
        runs.append((d_off, s_off, length * block))
        d_off += length * block
        s_off += length * block
    total = d_off
    before = [s.nbytes for s in ws.stats]
    dst[:] = 0
    xfer, done = ws.post_read(_runs_post(peer, src, dst, runs))
    assert done and ws.poll(xfer)
    ws.release(xfer)
    for d, s, n in runs:
        assert np.array_equal(dst[d:d + n], src[s:s + n])
    assert not dst[total:].any()
    moved = [a - b for a, b in zip((s.nbytes for s in ws.stats), before, strict=True)]
    assert sum(moved) == total
    k = max(1, min(3, total // ws.min_part_nbytes))
    if total < 2 * ws.min_part_nbytes:
        assert moved[0] == total  # small: whole, on worker 0
    else:
        share = total / k
        for m in moved[:k]:
            assert abs(m - share) <= 2 * RUN_CUT_SLACK * share + 1, (moved, total)
    assert ws.counts().transfers == 0


def test_contiguous_read_is_one_descriptor_split_over_every_worker(three) -> None:
    ws, peer, src, dst = three
    xfer, done = ws.post_read(_runs_post(peer, src, dst, [(0, 0, 96 * MiB)]))
    assert done and ws.poll(xfer)
    ws.release(xfer)
    assert np.array_equal(dst, src)
    assert [s.reads for s in ws.stats] == [1, 1, 1]
    assert [s.nbytes for s in ws.stats] == [32 * MiB] * 3
    # a part of one descriptor goes on a fresh list, as the daemon posts such READs
    assert [p.fresh_posts for p in ws.posters] == [1, 1, 1]
    assert [p.prepped_posts for p in ws.posters] == [0, 0, 0]


@settings(max_examples=150, deadline=None)
@given(reads(), st.integers(2, 8))
def test_few_descriptors_split_in_python_exactly_as_with_numpy(read, parts: int) -> None:
    """READs of a few descriptors take a plain-Python path (cheaper per call); it must
    cut and trim exactly as the numpy path does."""
    from kvd.transport.remote import split

    la, ra, nb = read
    post = _post(la, ra, nb)
    fast = split.split_bytes(la, ra, nb, parts)
    fast_parts = [split.part_of(post, a, b) for a, b in zip(fast, fast[1:], strict=False)]
    saved = split.SMALL_READ_DESCRIPTORS
    split.SMALL_READ_DESCRIPTORS = -1
    try:
        slow = split.split_bytes(la, ra, nb, parts)
        slow_parts = [split.part_of(post, a, b) for a, b in zip(slow, slow[1:], strict=False)]
    finally:
        split.SMALL_READ_DESCRIPTORS = saved
    assert fast == slow
    for f, s in zip(fast_parts, slow_parts, strict=True):
        for field in ("local_addrs", "remote_addrs", "nbytes", "local_devs", "remote_devs"):
            assert np.array_equal(getattr(f, field), getattr(s, field)), field

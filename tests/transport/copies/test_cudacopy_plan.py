"""The CUDA copier without CUDA: its plan (which ranges go where, on which streams, how
staged copies are batched into slots), and its handle logic over a simulated GPU
whose "device memory" is host memory and whose streams run only when told to.

The simulation proves the copier's bookkeeping (completion only once every event is
observed, staging pipeline, release waits, failures), not CUDA's behaviour: that is
tests/transport/copies/test_cudacopy_cuda.py, on a GPU (scripts/gpu_check_local_copy.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.errors import TransferError
from kvd.transport.copies.cudacopy import (
    HOST,
    CudaCopier,
    Lane,
    plan_device_copy,
    stage_batches,
)
from kvd.transport.copies.gather import chunk_descriptors
from tests.support.sim_gpu import SimGpu

MIB = 1 << 20


def byte_map(triples) -> dict[int, int]:
    out: dict[int, int] = {}
    for d, s, n in triples:
        for k in range(n):
            assert d + k not in out
            out[d + k] = s + k
    return out


def lane_triples(lane: Lane):
    for part in lane.parts:
        yield from zip(part.dst.tolist(), part.src.tolist(), part.nbytes.tolist(),
                       strict=True)


def test_lanes_by_device_pair_kind_and_issuing_device():
    # two GPUs and the host: d2d on 0, peer 0 -> 1, h2d to 1, d2h from 0 (pinned/not)
    dst = np.array([0, 100, 200, 300, 400, 500]) + (1 << 30)
    src = np.array([0, 100, 200, 300, 400, 500]) + (1 << 20)
    n = np.full(6, 50)
    ddev = [0, 1, 1, HOST, HOST, 0]
    sdev = [0, 0, HOST, 0, 0, 0]
    pinned = [(int(dst[3]), 50)]
    lanes = plan_device_copy(dst, src, n, ddev, sdev, pinned=pinned,
                             min_part_nbytes=1)
    got = [(ln.kind, ln.src_dev, ln.dst_dev, ln.device, ln.staged, ln.total) for ln in lanes]
    assert got == [("d2d", 0, 0, 0, False, 100), ("peer", 0, 1, 1, False, 50),
                   ("h2d", HOST, 1, 1, True, 50), ("d2h", 0, HOST, 0, False, 50),
                   ("d2h", 0, HOST, 0, True, 50)]
    # d2d's two descriptors (first and last) are in one lane, in order
    assert [t[0] - (1 << 30) for t in lane_triples(lanes[0])] == [0, 500]


def test_host_to_host_is_refused_and_devices_checked():
    with pytest.raises(ValueError, match="LocalCopier"):
        plan_device_copy([0], [4096], [16], HOST, HOST)
    with pytest.raises(ValueError, match="devices for"):
        plan_device_copy([0, 64], [4096, 8192], [16, 16], [0], 0)
    with pytest.raises(ValueError, match="below"):
        plan_device_copy([0], [4096], [16], -2, 0)


def test_streams_share_a_large_lane_evenly():
    rng = np.random.default_rng(0)
    blocks = 512  # 1 GiB of 2 MiB blocks, shuffled on both sides
    dst = rng.permutation(blocks) * 2 * MIB + (1 << 40)
    src = rng.permutation(blocks) * 2 * MIB
    for streams in (1, 2, 4):
        (lane,) = plan_device_copy(dst, src, np.full(blocks, 2 * MIB), 0, 0, streams=streams)
        assert len(lane.parts) == streams
        for part in lane.parts:
            assert abs(part.total - (1 << 30) / streams) < 4096
    (small,) = plan_device_copy(dst[:2], src[:2], np.full(2, 2 * MIB), 0, 0, streams=4)
    assert len(small.parts) == 1  # 4 MiB: not worth a second stream


@st.composite
def device_copies(draw):
    count = draw(st.integers(1, 30))
    sizes = draw(st.lists(st.integers(1, 5000), min_size=count, max_size=count))
    dst = np.cumsum([0] + sizes[:-1]) + (1 << 30)
    order = draw(st.permutations(range(count)))
    src = [int(dst[i]) - (1 << 29) for i in order]  # a permutation of the same ranges
    src_sizes = [sizes[i] for i in order]
    # sizes must match pairwise: use the source's order for both
    dst_addrs = np.cumsum([0] + src_sizes[:-1]) + (1 << 30)
    devs = st.sampled_from([HOST, 0, 1])
    sdev = [draw(devs) for _ in range(count)]
    ddev = [draw(devs.filter(lambda d, s=s: not (d == HOST and s == HOST))) for s in sdev]
    return dst_addrs, np.array(src), np.array(src_sizes), ddev, sdev


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(copy=device_copies(), streams=st.integers(1, 4), slot=st.integers(1, 3000))
def test_every_byte_goes_once_to_its_lane_and_slots_pack_it(copy, streams, slot):
    dst, src, n, ddev, sdev = copy
    lanes = plan_device_copy(dst, src, n, ddev, sdev, streams=streams, min_part_nbytes=64)
    want: dict[tuple[int, int], list] = {}
    for d, s, k, dd, sd in zip(dst.tolist(), src.tolist(), n.tolist(), ddev, sdev,
                               strict=True):
        want.setdefault((sd, dd), []).append((d, s, k))
    assert {(ln.src_dev, ln.dst_dev) for ln in lanes} == set(want)
    for lane in lanes:
        assert byte_map(lane_triples(lane)) == byte_map(want[(lane.src_dev, lane.dst_dev)])
        assert lane.staged == (HOST in (lane.src_dev, lane.dst_dev))  # nothing pinned
        if not lane.staged:
            continue
        batches = stage_batches(lane, slot)
        moved = []
        for batch in batches:
            assert batch.nbytes <= slot
            offs = [(off, k) for _, _, k, off in batch.pieces]
            assert offs[0][0] == 0
            for (o1, k1), (o2, _) in zip(offs, offs[1:], strict=False):
                assert o2 == o1 + k1  # packed, no gap, no overlap
            assert offs[-1][0] + offs[-1][1] == batch.nbytes
            for host, dev, k, _ in batch.pieces:
                moved.append((host, dev, k) if lane.kind == "d2h" else (dev, host, k))
        assert all(b.nbytes == slot for b in batches[:-1])
        assert byte_map(moved) == byte_map(lane_triples(lane))


def sim_copy(rng, count=24, block=4096):
    src = rng.integers(0, 256, count * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    d = rng.permutation(count) * block + dst.ctypes.data
    s = rng.permutation(count) * block + src.ctypes.data
    return dst, src, d, s, np.full(count, block)


def expected(dst, src, d, s, n):
    out = dst.copy()
    for da, sa, k in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
        o, p = da - dst.ctypes.data, sa - src.ctypes.data
        out[o:o + k] = src[p:p + k]
    return out


@pytest.mark.parametrize(("ddev", "sdev", "slot"), [
    (0, 0, 4096), (1, 0, 4096), (0, HOST, 5000), (HOST, 0, 5000), (HOST, 1, 1 << 20)])
def test_simulated_copy_is_byte_exact_and_ends_only_when_events_are_observed(ddev, sdev, slot):
    rng = np.random.default_rng(5)
    dst, src, d, s, n = sim_copy(rng)
    want = expected(dst, src, d, s, n)
    gpu = SimGpu(auto=False)
    with CudaCopier(streams_per_device=2, slot_nbytes=slot, _runtime=(gpu, gpu)) as c:
        h = c.post(d, s, n, dst_devs=ddev, src_devs=sdev)
        staged = HOST in (ddev, sdev)
        if not staged:
            assert c.poll(h) is False  # enqueued, not observed complete
            assert not dst.any()
            gpu.run()
        assert c.wait(h, timeout_s=10)
        c.release(h)
        assert c.counts().handles == 0
    np.testing.assert_array_equal(dst, want)


def test_simulated_registered_host_memory_goes_direct():
    rng = np.random.default_rng(6)
    dst, src, d, s, n = sim_copy(rng)
    want = expected(dst, src, d, s, n)
    gpu = SimGpu()
    c = CudaCopier(_runtime=(gpu, gpu))
    c._pinned[dst.ctypes.data] = dst.nbytes  # as register_host records it
    h = c.post(d, s, n, dst_devs=HOST, src_devs=0)
    assert [lane.staged for lane in c.last_lanes] == [False]
    assert c.wait(h, timeout_s=10)
    c.release(h)
    np.testing.assert_array_equal(dst, want)


def test_simulated_release_before_done_waits_or_raises_keeping_the_handle():
    rng = np.random.default_rng(7)
    dst, src, d, s, n = sim_copy(rng)
    want = expected(dst, src, d, s, n)
    gpu = SimGpu(auto=False)
    with CudaCopier(_runtime=(gpu, gpu)) as c:
        h = c.post(d, s, n, dst_devs=0, src_devs=0)
        with pytest.raises(TransferError, match="still running"):
            c.release(h, timeout_s=0.01)
        assert c.counts().handles == 1
        threading.Timer(0.05, gpu.run).start()
        c.release(h)  # waits for the GPU
        assert c.counts().handles == 0
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("staged", [False, True])
def test_simulated_refused_copy_fails_on_poll_after_what_was_enqueued_ended(staged):
    rng = np.random.default_rng(8)
    dst, src, d, s, n = sim_copy(rng)
    gpu = SimGpu(auto=False, fail_at=5)
    with CudaCopier(streams_per_device=1, slot_nbytes=4096, _runtime=(gpu, gpu)) as c:
        h = c.post(d, s, n, dst_devs=HOST if staged else 0, src_devs=0)
        if not staged:
            assert c.poll(h) is False  # four copies enqueued and not yet run
            gpu.run()
        deadline = 100
        while deadline:
            try:
                if c.poll(h):
                    break
            except TransferError as e:
                assert "simulated failure" in str(e)
                break
            deadline -= 1
            gpu.run()
            threading.Event().wait(0.01)
        else:
            pytest.fail("the failed copy never ended")
        assert all(stream.done == len(stream.queue) for stream in gpu.streams.values())
        c.release(h)


def test_simulated_unknown_handle_and_closed_copier():
    gpu = SimGpu()
    c = CudaCopier(_runtime=(gpu, gpu))
    with pytest.raises(TransferError, match="unknown"):
        c.poll(99)
    c.close()
    buf = np.zeros(8192, dtype=np.uint8)
    with pytest.raises(TransferError, match="closed"):
        c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [16], dst_devs=0, src_devs=0)


def test_without_cuda_the_copier_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TransferError, match="no CUDA device"):
        CudaCopier()


# ------------------------------------------------------------ the gather kernel's table


def _byte_pairs(rows) -> np.ndarray:
    """Every (dst byte, src byte) address pair the rows move, in order."""
    return np.concatenate([np.stack([np.arange(a, a + k), np.arange(b, b + k)], axis=1)
                           for a, b, k in rows])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20),
                          st.integers(1, 5000)), min_size=1, max_size=30),
       st.sampled_from([1, 7, 64, 4096]))
def test_chunk_table_moves_exactly_the_pieces_bytes(pieces, chunk):
    """Independent oracle: the table moves the very byte pairs of the pieces, in order,
    in chunks of 1..chunk bytes."""
    d, s, n = (np.array(x, dtype=np.int64) for x in zip(*pieces, strict=True))
    table = chunk_descriptors(d, s, n, chunk)
    assert (table[:, 2] >= 1).all() and (table[:, 2] <= chunk).all()
    assert np.array_equal(_byte_pairs(table.tolist()), _byte_pairs(pieces))


def test_chunk_table_keeps_order_and_cuts_at_the_chunk_size():
    t = chunk_descriptors([1000, 0], [5000, 70_000], [150_000, 3], chunk_nbytes=65536)
    assert t.tolist() == [[1000, 5000, 65536], [66536, 70536, 65536],
                          [132072, 136072, 18928], [0, 70_000, 3]]
    with pytest.raises(ValueError):
        chunk_descriptors([0], [0], [1], chunk_nbytes=0)


def test_simulated_gpu_has_no_kernel_and_copies_piece_by_piece():
    gpu = SimGpu()
    c = CudaCopier(streams_per_device=1, _runtime=(gpu, gpu))
    assert c.kernel is False
    dst, src, d, s, n = sim_copy(np.random.default_rng(3))
    want = expected(dst, src, d, s, n)
    h = c.post(d, s, n, dst_devs=0, src_devs=0)
    assert c.wait(h)
    c.release(h)
    assert np.array_equal(dst, want)
    assert gpu.calls >= 1


def test_a_caller_spinning_on_poll_does_not_starve_the_staging_thread():
    """Staged copies run on the copier's thread, which needs the GIL between its steps;
    a caller polling in a tight loop held it for whole switch intervals (on an H200 the
    staged path ran at 0.2 GB/s so). poll yields it while a staged part runs: with a
    1 s switch interval, a copy of 8 slots ends in well under one interval."""
    import sys
    import time

    rng = np.random.default_rng(11)
    dst, src, d, s, n = sim_copy(rng, count=64, block=4096)
    want = expected(dst, src, d, s, n)
    gpu = SimGpu()
    old = sys.getswitchinterval()
    with CudaCopier(streams_per_device=1, slot_nbytes=8 * 4096, _runtime=(gpu, gpu)) as c:
        sys.setswitchinterval(1.0)
        try:
            t0 = time.perf_counter()
            h = c.post(d, s, n, dst_devs=HOST, src_devs=0)
            while not c.poll(h):
                pass
            elapsed = time.perf_counter() - t0
        finally:
            sys.setswitchinterval(old)
        c.release(h)
    np.testing.assert_array_equal(dst, want)
    # Starved, the staging thread waits a whole switch interval (1 s) per slot; a busy
    # host's scheduling costs far less than one interval.
    assert elapsed < 1.0, f"{elapsed:.2f} s: the poll loop starved the staging thread"

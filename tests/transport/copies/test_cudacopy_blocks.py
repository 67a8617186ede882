"""The CUDA copier's block copies (`CudaCopier.post_blocks`) over the simulated GPU: the
bytes each block pair moves, the checks on the ids, the per-piece path while the kernels
compile (on a thread of their own), and the host's work per pull, which must not grow
with how finely each block is cut (kvd.planner.blocks)."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import TransferError
from kvd.planner.blocks import BlockCopy, BlockTable
from kvd.transport.copies.cudacopy import HOST, CudaCopier
from kvd.transport.copies.gather import KERNEL_CHUNK_NBYTES, block_chunks
from tests.support.sim_gpu import SimGpu


def pools(blocks: int, block_nbytes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, blocks * block_nbytes, dtype=np.uint8),
            np.zeros(blocks * block_nbytes, dtype=np.uint8))


def layer_major(src: np.ndarray, dst: np.ndarray, blocks: int, rows: int, seg: int,
                dst_devs=0, src_devs=0) -> BlockTable:
    """A pool pair cut like a layer-major KV cache: ``rows`` segments of ``seg`` bytes
    per block, segment j of block b at (j * blocks + b) * seg; the destination keeps
    only the second half of each source segment past the first row (a TP split)."""
    j = np.arange(rows, dtype=np.int64)
    return BlockTable(dst=dst.ctypes.data + j * blocks * seg, src=src.ctypes.data
                      + j * blocks * seg, nbytes=np.full(rows, seg), dst_stride=np.full(rows, seg),
                      src_stride=np.full(rows, seg), dst_devs=dst_devs, src_devs=src_devs,
                      dst_blocks=blocks, src_blocks=blocks)


def oracle(dst: np.ndarray, src: np.ndarray, bc: BlockCopy) -> np.ndarray:
    """``dst`` once ``bc`` has run (numpy, on the host)."""
    out = dst.copy()
    d, s, n, _, _ = bc.expand()
    for a, b, k in zip((d - dst.ctypes.data).tolist(), (s - src.ctypes.data).tolist(),
                       n.tolist(), strict=True):
        out[a:a + k] = src[b:b + k]
    return out


def kernel_copier(gpu: SimGpu, **kw) -> CudaCopier:
    c = CudaCopier(streams_per_device=1, _runtime=(gpu, gpu), **kw)
    assert c.wait_kernels(10), c.kernel_error
    return c


@pytest.mark.parametrize("n_ids", [1, 3, 40])
def test_block_copy_moves_the_blocks_bytes_in_one_launch(n_ids):
    blocks, rows, seg = 48, 5, 3000  # 3000: not a multiple of 16, one chunk per row
    src, dst = pools(blocks, rows * seg, n_ids)
    table = layer_major(src, dst, blocks, rows, seg)
    rng = np.random.default_rng(n_ids)
    bc = BlockCopy(table, rng.permutation(blocks)[:n_ids], rng.permutation(blocks)[:n_ids])
    want = oracle(dst, src, bc)
    gpu = SimGpu(auto=False, kernels=True)
    with kernel_copier(gpu) as c:
        h = c.post_blocks(bc)
        assert c.last_block_path == "kernel"
        assert c.poll(h) is False and not dst.any()  # enqueued, not observed complete
        gpu.run()
        assert c.wait(h, timeout_s=10)
        c.release(h)
        assert c.counts().handles == 0
    np.testing.assert_array_equal(dst, want)
    (name, grid, args), = gpu.launches  # one launch, whatever the blocks and rows
    assert name == "kvd_block_copy" and grid[0] == n_ids * rows
    assert args[3] == (0 if n_ids == 1 else n_ids)  # one block: ids as arguments


def test_the_table_goes_to_the_gpu_once_and_a_pull_sends_only_its_ids():
    blocks, rows, seg = 16, 3, 200_000  # rows above one chunk: 4 chunks each
    src, dst = pools(blocks, rows * seg, 1)
    table = layer_major(src, dst, blocks, rows, seg)
    gpu = SimGpu(kernels=True)
    with kernel_copier(gpu) as c:
        lanes = c.prepare_blocks(table)
        assert c.prepare_blocks(table) is lanes  # cached per table
        (lane,) = lanes.values()
        assert lane.nchunks == rows * -(-seg // KERNEL_CHUNK_NBYTES)
        np.testing.assert_array_equal(lane.chunks.arr, block_chunks(table))
        for k in range(3):
            bc = BlockCopy(table, [k, k + 5], [k + 9, k + 1])
            want = oracle(dst, src, bc)
            h = c.post_blocks(bc)
            assert c.wait(h, 10)
            c.release(h)
            np.testing.assert_array_equal(dst, want)
        assert [a[0] is lane.chunks for _, _, a in gpu.launches] == [True] * 3


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.sampled_from([1, 8, 16, 24, 70_001]),
       st.data())
def test_block_copy_equals_its_expansion_for_any_pattern(blocks_log, rows, seg, data):
    """Oracle: what the expanded descriptors move, byte for byte (segments of odd sizes,
    some longer than a kernel chunk, destination stride apart from the source's)."""
    blocks = 1 << blocks_log
    src, dst = pools(blocks, rows * seg + 7, seg)
    j = np.arange(rows, dtype=np.int64)
    table = BlockTable(dst.ctypes.data + j * seg, src.ctypes.data + 7 + j * seg * blocks,
                       np.full(rows, seg), np.full(rows, rows * seg), np.full(rows, seg), 0, 0,
                       blocks, blocks)
    n = data.draw(st.integers(1, blocks))
    d_ids = data.draw(st.permutations(range(blocks)))[:n]
    s_ids = data.draw(st.lists(st.integers(0, blocks - 1), min_size=n, max_size=n))
    bc = BlockCopy(table, np.array(d_ids), np.array(s_ids))
    want = oracle(dst, src, bc)
    gpu = SimGpu(kernels=True)
    with kernel_copier(gpu) as c:
        h = c.post_blocks(bc)
        assert c.wait(h, 10)
        c.release(h)
    np.testing.assert_array_equal(dst, want)


def test_ids_are_checked_before_anything_runs():
    src, dst = pools(8, 64, 2)
    table = layer_major(src, dst, 8, 2, 32)
    gpu = SimGpu(kernels=True)
    with kernel_copier(gpu) as c:
        for d, s, what in (([8], [0], "destination block ids outside"),
                           ([0], [-1], "source block ids outside"),
                           (np.array([1, 2, 1]), np.array([0, 1, 2]), "named twice"),
                           ([1, 2, 1], [0, 1, 2], "named twice"),
                           ([1], [0, 1], "1 destination and 2 source"),
                           ([1.0], [0], "must be integers"),
                           (np.array([1.0, 2.0]), np.array([0, 1]), "must be integers"),
                           ([], [], "no block ids")):
            with pytest.raises(ValueError, match=what):
                c.post_blocks(BlockCopy(table, d, s))
        assert not gpu.launches and c.counts().handles == 0


def test_before_the_kernels_are_built_a_block_copy_takes_the_per_piece_path():
    """Compiling runs on a thread of its own (not the caller's), started with the
    copier; a copy posted meanwhile is expanded and copied piece by piece."""
    src, dst = pools(8, 4 * 100, 3)
    table = layer_major(src, dst, 8, 4, 100)
    gpu = SimGpu(kernels=True, compile_delay_s=0.3)
    c = CudaCopier(streams_per_device=1, _runtime=(gpu, gpu))
    try:
        t0 = time.perf_counter()
        bc = BlockCopy(table, [3, 1], [2, 7])
        want = oracle(dst, src, bc)
        h = c.post_blocks(bc)
        assert time.perf_counter() - t0 < 0.2  # did not wait for the compile
        assert c.last_block_path == "expanded" and not gpu.launches and gpu.calls == 8
        assert c.wait(h, 10)
        c.release(h)
        np.testing.assert_array_equal(dst, want)
        assert c.wait_kernels(10)
        assert {t for _, t in gpu.compiled} <= {"kvd-nvrtc-0", "kvd-nvrtc-1"}
        # each compile thread made its GPU's context current first (a new thread has none)
        assert sorted(gpu.set_device) == [(0, "kvd-nvrtc-0"), (1, "kvd-nvrtc-1")]
        assert threading.current_thread().name not in {t for _, t in gpu.compiled}
        assert set(c.kernel_compile_s) == {0, 1} and min(c.kernel_compile_s.values()) >= 0.3
        h = c.post_blocks(BlockCopy(table, [0], [0]))
        assert c.last_block_path == "kernel"
        assert c.wait(h, 10)
        c.release(h)
    finally:
        c.close()


def test_compile_time_is_logged(caplog):
    gpu = SimGpu(kernels=True, devices=1)
    with caplog.at_level("INFO", logger="kvd.transport"), \
            CudaCopier(_runtime=(gpu, gpu)) as c:
        assert c.wait_kernels(10)
    assert any("compiled in" in r.getMessage() and "GPU 0" in r.getMessage()
               for r in caplog.records)


def test_without_nvrtc_block_copies_stay_per_piece_and_say_why():
    src, dst = pools(4, 64, 4)
    table = layer_major(src, dst, 4, 2, 32)
    gpu = SimGpu(kernels=True, compile_error="nvrtc: not found", devices=1)
    with CudaCopier(_runtime=(gpu, gpu)) as c:
        assert c.wait_kernels(10) is False
        assert "nvrtc: not found" in c.kernel_error
        bc = BlockCopy(table, [1, 2], [3, 0])
        want = oracle(dst, src, bc)
        h = c.post_blocks(bc)
        assert c.last_block_path == "expanded"
        assert c.wait(h, 10)
        c.release(h)
        np.testing.assert_array_equal(dst, want)
    with pytest.raises(TransferError, match="nvrtc"):
        CudaCopier(kernel=True, _runtime=(gpu, gpu)).post_blocks(bc)


def test_rows_on_two_gpus_are_one_launch_per_device_pair_and_host_rows_are_expanded():
    src, dst = pools(8, 4 * 64, 5)
    j = np.arange(4, dtype=np.int64)
    common = dict(dst=dst.ctypes.data + j * 8 * 64, src=src.ctypes.data + j * 8 * 64,
                  nbytes=np.full(4, 64), dst_stride=np.full(4, 64), src_stride=np.full(4, 64),
                  dst_blocks=8, src_blocks=8)
    gpu = SimGpu(kernels=True)
    with kernel_copier(gpu) as c:
        two = BlockTable(dst_devs=[0, 0, 1, 1], src_devs=0, **common)
        bc = BlockCopy(two, [1, 2, 3], [4, 5, 6])
        want = oracle(dst, src, bc)
        h = c.post_blocks(bc)
        assert c.wait(h, 10)
        c.release(h)
        np.testing.assert_array_equal(dst, want)
        assert len(gpu.launches) == 2
        host = BlockTable(dst_devs=HOST, src_devs=0, **common)
        assert c.prepare_blocks(host) is None
        h = c.post_blocks(BlockCopy(host, [0], [0]))
        assert c.last_block_path == "expanded"
        assert c.wait(h, 10)
        c.release(h)


def test_release_of_a_running_block_copy_waits_for_it():
    src, dst = pools(8, 2 * 64, 6)
    table = layer_major(src, dst, 8, 2, 64)
    gpu = SimGpu(auto=False, kernels=True)
    with kernel_copier(gpu) as c:
        bc = BlockCopy(table, [1, 2], [3, 4])
        want = oracle(dst, src, bc)
        h = c.post_blocks(bc)
        with pytest.raises(TransferError, match="still running"):
            c.release(h, timeout_s=0.01)
        threading.Timer(0.05, gpu.run).start()
        c.release(h)
        np.testing.assert_array_equal(dst, want)


# ------------------------------------------------------------ host work per pull

GIB = 1 << 30
BLOCKS = 512


class Poster:
    """Posts pulls of 1 GiB as ``BLOCKS`` blocks of ``rows`` pieces each (the simulated
    GPU runs nothing: addresses point nowhere) and keeps the posting thread's CPU time
    of each."""

    def __init__(self, stack: contextlib.ExitStack, rows: int, *, expanded: bool) -> None:
        seg = GIB // BLOCKS // rows
        base_d, base_s = 1 << 40, 1 << 41
        self.pool = BLOCKS * 5 // 4
        j = np.arange(rows, dtype=np.int64)
        self.table = BlockTable(base_d + j * self.pool * seg, base_s + j * self.pool * seg,
                                np.full(rows, seg), np.full(rows, seg), np.full(rows, seg),
                                0, 0, self.pool, self.pool)
        self.rng = np.random.default_rng(rows)
        self.expanded = expanded
        self.copier = stack.enter_context(kernel_copier(SimGpu(kernels=True, dry=True,
                                                               devices=1)))
        self.times_s: list[float] = []
        self.post(keep=False)  # the first pays one-time costs

    def post(self, keep: bool = True) -> None:
        c = self.copier
        bc = BlockCopy(self.table, self.rng.permutation(self.pool)[:BLOCKS],
                       self.rng.permutation(self.pool)[:BLOCKS])
        t0 = time.thread_time()
        if self.expanded:
            d, s, n, _, _ = bc.expand()
            h = c.post(d, s, n, dst_devs=0, src_devs=0)
        else:
            h = c.post_blocks(bc)
        if keep:
            self.times_s.append(time.thread_time() - t0)
        assert c.wait(h, 10)
        c.release(h)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def test_host_work_per_pull_does_not_grow_with_its_pieces():
    """1 GiB as 512 blocks of 1, 16 or 128 pieces (512, 8,192 and 65,536 pieces of 2 MiB,
    128 KiB and 16 KiB): the posting thread's CPU time per pull stays within 2x. The same
    pulls expanded to descriptors (what the copier did before) cost in proportion. The
    sizes take turns, pull by pull, so that a busy host slows them alike (measured one
    size after the other, a burst of load once made the first size 2.3x the last)."""
    with contextlib.ExitStack() as stack:
        posters = {pieces: Poster(stack, pieces // BLOCKS, expanded=False)
                   for pieces in (512, 8192, 65536)}
        expanded = Poster(stack, 65536 // BLOCKS, expanded=True)
        for i in range(25):
            for p in posters.values():
                p.post()
            if i < 3:
                expanded.post()
    blocks = {pieces: p.median_s for pieces, p in posters.items()}
    print({k: f"{v * 1e6:.0f} us" for k, v in blocks.items()},
          f"65536 pieces expanded: {expanded.median_s * 1e6:.0f} us")
    assert max(blocks.values()) <= 2 * min(blocks.values()), blocks
    assert expanded.median_s > 4 * blocks[65536]

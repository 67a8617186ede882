"""`LocalMover` picks the copier by the memory of both sides: DRAM to DRAM on the copy
threads, anything with a VRAM side on the CUDA copier, a DRAM side named as the host
(staged through page-locked slots). Runs on CPU: the CUDA copier over the simulated GPU
of test_cudacopy_plan.py, whose "device" memory is host memory, so bytes are checked."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvd.daemon.pull.local import LocalMover
from kvd.transport.base import ReadPost
from kvd.transport.copies.cudacopy import HOST, CudaCopier
from kvd.transport.copies.localcopy import LocalCopier
from tests.support.sim_gpu import SimGpu

BLOCK = 4096


def _post(dst: np.ndarray, src: np.ndarray, remote_mem: str, local_mem: str,
          rng: np.random.Generator) -> ReadPost:
    n = len(src) // BLOCK
    d, s = rng.permutation(n) * BLOCK, rng.permutation(n) * BLOCK
    devs = np.zeros(n, dtype=np.int64)
    return ReadPost(peer="self", local_addrs=(d + dst.ctypes.data).astype(np.uint64),
                    remote_addrs=(s + src.ctypes.data).astype(np.uint64),
                    nbytes=np.full(n, BLOCK, dtype=np.uint64), mem_type=remote_mem, notif=b"",
                    local_devs=devs, remote_devs=devs,
                    local_mem_type="" if local_mem == remote_mem else local_mem)


@pytest.mark.parametrize(("remote_mem", "local_mem", "kind"), [
    ("VRAM", "DRAM", "d2h"), ("DRAM", "VRAM", "h2d"), ("VRAM", "VRAM", "d2d"),
    ("DRAM", "DRAM", None)])
def test_the_copier_follows_both_sides_memory(remote_mem, local_mem, kind):
    gpu = SimGpu()
    made: list[CudaCopier] = []

    def cuda() -> CudaCopier:
        made.append(CudaCopier(streams_per_device=1, slot_nbytes=3 * BLOCK,
                               _runtime=(gpu, gpu)))
        return made[-1]

    mover = LocalMover(LocalCopier(threads=1), cuda_copier=cuda)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 32 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    post = _post(dst, src, remote_mem, local_mem, rng)

    async def run() -> None:
        [res] = mover.post_now([post])
        if res.xfer_id is not None:
            while True:
                st = (await mover.poll([res.xfer_id]))[res.xfer_id]
                if st.state.name != "PENDING":
                    break
            assert st.state.name == "DONE", st
            await mover.release([res.xfer_id])
        else:
            assert res.done

    asyncio.run(run())
    want = np.zeros_like(src)
    for a, b in zip((post.local_addrs - dst.ctypes.data).tolist(),
                    (post.remote_addrs - src.ctypes.data).tolist(), strict=True):
        want[a:a + BLOCK] = src[b:b + BLOCK]
    np.testing.assert_array_equal(dst, want)
    if kind is None:
        assert made == []  # DRAM to DRAM never touches CUDA
    else:
        [copier] = made
        assert [lane.kind for lane in copier.last_lanes] == [kind]
        assert all(lane.staged for lane in copier.last_lanes) == (kind != "d2d")
        host_side = {"d2h": "dst_dev", "h2d": "src_dev"}.get(kind)
        if host_side:
            assert getattr(copier.last_lanes[0], host_side) == HOST
    mover.close()


class _Unbuilt:
    """A descriptor column nobody may build (np.asarray or len would)."""

    def __array__(self, dtype=None, copy=None):
        raise AssertionError("descriptors built")

    def __len__(self):
        raise AssertionError("descriptors built")


def test_a_vram_pull_given_as_block_ids_goes_to_the_block_kernel_without_descriptors():
    from kvd.planner.blocks import BlockCopy, BlockTable
    from tests.support.sim_gpu import SimGpu as KernelGpu

    gpu = KernelGpu(kernels=True)
    made: list[CudaCopier] = []

    def cuda() -> CudaCopier:
        made.append(CudaCopier(streams_per_device=1, _runtime=(gpu, gpu)))
        made[-1].wait_kernels(10)
        return made[-1]

    mover = LocalMover(LocalCopier(threads=1), cuda_copier=cuda)
    rng = np.random.default_rng(8)
    blocks, rows, seg = 16, 3, 512
    src = rng.integers(0, 256, blocks * rows * seg, dtype=np.uint8)
    dst = np.zeros_like(src)
    j = np.arange(rows)
    table = BlockTable(dst.ctypes.data + j * blocks * seg, src.ctypes.data + j * blocks * seg,
                       np.full(rows, seg), np.full(rows, seg), np.full(rows, seg), 0, 0,
                       blocks, blocks)
    bc = BlockCopy(table, rng.permutation(blocks)[:10], rng.permutation(blocks)[:10])
    post = ReadPost(peer="self", local_addrs=_Unbuilt(), remote_addrs=_Unbuilt(),
                    nbytes=_Unbuilt(), mem_type="VRAM", notif=b"", local_devs=_Unbuilt(),
                    remote_devs=_Unbuilt(), blocks=bc)

    async def run() -> None:
        [res] = mover.post_now([post])
        assert res.error is None, res.error
        if res.xfer_id is not None:
            while (await mover.poll([res.xfer_id]))[res.xfer_id].state.name == "PENDING":
                pass
            await mover.release([res.xfer_id])

    asyncio.run(run())
    want = np.zeros_like(src)
    d, s, n, _, _ = bc.expand()
    for a, b, k in zip((d - dst.ctypes.data).tolist(), (s - src.ctypes.data).tolist(),
                       n.tolist(), strict=True):
        want[a:a + k] = src[b:b + k]
    np.testing.assert_array_equal(dst, want)
    [copier] = made
    assert copier.last_block_path == "kernel" and len(gpu.launches) == 1
    mover.close()


def test_start_cuda_makes_the_copier_on_a_thread_and_pulls_use_that_one():
    import threading
    import time

    made: list[tuple[str, CudaCopier]] = []
    gpu = SimGpu()

    def cuda() -> CudaCopier:
        time.sleep(0.3)  # CUDA's start and the kernels' compile, say
        made.append((threading.current_thread().name,
                     CudaCopier(streams_per_device=1, _runtime=(gpu, gpu))))
        return made[-1][1]

    mover = LocalMover(LocalCopier(threads=1), cuda_copier=cuda)
    t0 = time.perf_counter()
    mover.start_cuda()
    mover.start_cuda()  # once
    assert time.perf_counter() - t0 < 0.1
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    [res] = mover.post_now([_post(dst, src, "VRAM", "VRAM", rng)])  # waits for that copier
    assert [name for name, _ in made] == ["kvd-cuda-start"]
    assert res.error is None
    mover.close()


def test_start_cuda_failure_fails_vram_pulls_as_before():
    from kvd.errors import TransferError

    def cuda() -> CudaCopier:
        raise TransferError("CUDA copies: no CUDA device visible")

    mover = LocalMover(LocalCopier(threads=1), cuda_copier=cuda)
    mover.start_cuda()
    rng = np.random.default_rng(10)
    src = rng.integers(0, 256, 8 * BLOCK, dtype=np.uint8)
    [res] = mover.post_now([_post(np.zeros_like(src), src, "VRAM", "VRAM", rng)])
    assert res.xfer_id is None and "no CUDA device" in str(res.error)
    mover.close()

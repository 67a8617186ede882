"""`LocalMover` picks the copier by the memory of both sides: DRAM to DRAM on the copy
threads, anything with a VRAM side on the CUDA copier, a DRAM side named as the host
(staged through page-locked slots). Runs on CPU: the CUDA copier over the simulated GPU
of test_cudacopy_plan.py, whose "device" memory is host memory, so bytes are checked."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_cudacopy_plan import SimGpu

from kvd.daemon.pull.local import LocalMover
from kvd.transport.base import ReadPost
from kvd.transport.cudacopy import HOST, CudaCopier
from kvd.transport.localcopy import LocalCopier

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

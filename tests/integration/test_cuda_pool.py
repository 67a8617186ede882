"""VRAM pools (device="cuda"). The GPU path is untested on CPU-only machines:
those tests skip; what runs everywhere is the clear refusal without a GPU."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from kvd.errors import KvdError
from kvd.tools.localcluster import DaemonProcess
from kvd.wire.protocol import LayoutSpec, ModelSpec

MODEL = ModelSpec(name="cuda", num_kv_heads=2, num_layers=2, head_dim=16)
LAYOUT = LayoutSpec(num_blocks=8, block_size_tokens=16)


def _gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.nixl
def test_cuda_daemon_without_gpu_refuses_registration_clearly(tmp_path):
    if _gpu():
        pytest.skip("a GPU is present: the refusal path does not apply")
    d = DaemonProcess.start("cuda", tmp_path, extra_args=["--device", "cuda"])
    try:
        with d.client() as c:
            with pytest.raises(KvdError, match="CUDA GPU"):
                c.register("e", MODEL, LAYOUT)
            assert c.status().engines == []  # nothing half-registered, daemon still serving
    finally:
        assert d.stop() == 0


def _open_and_check(handle, q) -> None:
    from kvd.pool.cuda import open_cuda_pool

    pool = open_cuda_pool(handle)
    q.put(int(pool.tensor().view(-1)[:4].float().sum().item()))


@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: VRAM pools untested here")
def test_cuda_pool_is_shared_with_another_process():
    import torch

    from kvd.pool.cuda import CudaPool

    pool = CudaPool.create("kvd-test", 1 << 20, 0)
    pool.tensor[:8] = 1
    handle = pool.handle((1 << 19,), "float16")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_open_and_check, args=(handle, q))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    expected = float(torch.tensor([1, 1], dtype=torch.uint8).view(torch.float16).float())
    assert q.get(timeout=5) == int(expected * 4)
    pool.close()

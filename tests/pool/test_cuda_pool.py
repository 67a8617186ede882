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
    import faulthandler

    faulthandler.enable()
    from kvd.pool.cuda import open_cuda_pool

    pool = open_cuda_pool(handle)
    q.put(int(pool.tensor().view(-1)[:4].float().sum().item()))
    pool.close()  # the engine drops its mapping before it exits (see MappedCudaPool.close)


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


def _allocate_inside_pool(handle, q) -> None:
    """The engine's side, as vLLM does it: one torch.zeros(total_bytes, int8) inside the
    connector's allocation context, then per-layer views of it."""
    import faulthandler

    faulthandler.enable()
    import torch

    from kvd.integrations.connector_core.cuda_alloc import cuda_pool_context
    from kvd.pool.cuda import open_cuda_pool

    pool = open_cuda_pool(handle)
    dev = f"cuda:{handle.device_index}"
    with cuda_pool_context(pool):
        kv = torch.zeros(handle.nbytes, dtype=torch.int8, device=dev)
        try:
            torch.empty(1 << 20, dtype=torch.int8, device=dev)
            second = "allocated"
        except RuntimeError:  # torch.OutOfMemoryError: nothing else may land in kvd's pool
            second = "refused"
    kv[:64] = torch.arange(64, dtype=torch.int8, device=dev)
    kv[-64:] = torch.arange(64, dtype=torch.int8, device=dev)
    torch.cuda.synchronize()
    q.put((kv.data_ptr() == pool.tensor().data_ptr(), second))
    del kv
    pool.close()


@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: the allocator shim is "
                    "untested here")
@pytest.mark.parametrize("nbytes", [3 << 20, (64 << 20) + 4096, 256 << 20])
def test_allocator_shim_serves_the_kv_allocation_from_kvd_pool(nbytes):
    """Sizes that torch rounds up (3 MiB -> a 20 MiB segment, 64 MiB + 4 KiB -> 66 MiB):
    the pool must hold the rounded segment or vLLM's allocation fails."""
    import torch

    from kvd.pool.cuda import CudaPool

    pool = CudaPool.create("kvd-test", nbytes, 0)
    handle = pool.handle((nbytes,), "int8")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_allocate_inside_pool, args=(handle, q))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    same_pointer, second = q.get(timeout=5)
    assert same_pointer, "vLLM's KV tensor is not kvd's pool"
    assert second == "refused"
    torch.cuda.synchronize()
    want = torch.arange(64, dtype=torch.int8, device="cuda:0").view(torch.uint8)
    assert torch.equal(pool.tensor[:64], want)  # the engine's writes are in kvd's memory
    assert torch.equal(pool.tensor[nbytes - 64:nbytes], want)
    pool.close()


@pytest.mark.nixl
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: VRAM pulls untested here")
@pytest.mark.parametrize("workers", ["1", "auto"])
def test_vram_pull_between_two_daemons_is_byte_exact(workers):
    """Two kvd serve --device cuda daemons on one GPU: CUDA IPC pools, a pull of random
    block ids, every block compared with the prefill pool (twice: after a warm-up and
    after zeroing the decode pool)."""
    from kvd.tools.bench.geometry import DEFAULT_KV_LAYOUT
    from kvd.tools.bench.vram import kvd_pulls

    res = kvd_pulls(64, "cuda", 0, 2, DEFAULT_KV_LAYOUT,
                    daemon_args=("--set", f"posting_workers={workers}"))
    assert res["verified"], res["logs"]
    assert res["nbytes"] >= 60 << 20


@pytest.mark.nixl
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: local VRAM pulls untested "
                    "here")
def test_local_vram_pull_on_one_daemon_is_a_device_copy():
    """Both engines on one kvd serve --device cuda: the pull is a copy the daemon issues on
    the GPU (kvd.transport.copies.cudacopy), every block compared with the prefill pool."""
    from kvd.tools.bench.geometry import DEFAULT_KV_LAYOUT
    from kvd.tools.bench.vram import kvd_pulls

    res = kvd_pulls(64, "cuda", 0, 2, DEFAULT_KV_LAYOUT, one_daemon=True)
    assert res["verified"], res["logs"]
    assert res["paths"] == ["local"]


@pytest.mark.nixl
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: VRAM pools untested here")
def test_a_daemon_whose_allocator_cannot_share_refuses_or_shares_for_real(tmp_path):
    """With expandable segments in kvd's environment, a VRAM pool is either shared for real
    (another process maps it and sees the daemon's bytes) or refused at registration in
    one line; never handed out unmappable."""
    d = DaemonProcess.start("cuda-exp", tmp_path, extra_args=["--device", "cuda"],
                            env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    try:
        with d.client(timeout_s=60) as c:
            try:
                rank = c.register("e", MODEL, LAYOUT)
            except KvdError as exc:
                assert "cannot be shared" in str(exc) and "\n" not in str(exc), str(exc)
                assert c.status().engines == []
                print("refused:", exc)
                return
            import torch

            rank.kv.view(-1)[:4] = torch.tensor([1, 2, 3, 4], dtype=rank.kv.dtype,
                                                device=rank.kv.device)
            torch.cuda.synchronize()
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_open_and_check, args=(rank.pool.handle, q))
            p.start()
            p.join(120)
            assert p.exitcode == 0
            assert q.get(timeout=5) == 10  # the engine's writes, seen by another process
            print("shared: expandable segments exported over IPC")
            c.deregister(rank)
    finally:
        assert d.stop() == 0


class _DramRanks:
    """A client whose registrations ask for DRAM pools (device_index -1)."""

    def __init__(self, client) -> None:
        self.client = client

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def register(self, *args, **kwargs):
        return self.client.register(*args, **kwargs, device_index=-1)


@pytest.mark.nixl
def test_a_cuda_daemon_hosts_dram_engines_too(tmp_path):
    """device_index -1: the rank's pool is DRAM (shm) on a --device cuda daemon, with or
    without a GPU; a pull between two such engines is a local copy, byte-exact (TP4 ->
    TP2); an engine's ranks cannot mix DRAM and VRAM; below -1 is refused."""
    from support.cluster import metric, run_transfer
    from support.matrix_cases import CASES

    from kvd.errors import IncompatibleError

    d = DaemonProcess.start("cuda-dram", tmp_path, extra_args=["--device", "cuda"])
    try:
        with d.client(timeout_s=60) as c:
            two = ModelSpec(name="cuda", num_kv_heads=2, num_layers=2, head_dim=16)
            p = c.register("p", two, LAYOUT, 0, 2, device_index=-1)
            assert p.pool.handle.kind == "shm"
            with pytest.raises(IncompatibleError, match="one kind of memory"):
                c.register("p", two, LAYOUT, 1, 2, device_index=0)
            with pytest.raises(KvdError, match="device_index -2"):
                c.register("r", MODEL, LAYOUT, device_index=-2)
            c.deregister(p)
            m, pshape, _, tokens, _ = CASES["prefill-tp-larger-4-2"]
            _, dshape, _, _, _ = CASES["decode-tp-larger-1-2"]
            dram = _DramRanks(c)
            res = run_transfer(d, d, dram, dram, m, pshape, dshape, tokens, timeout_s=30)
            assert res.recv.ok and res.sent.ok, (res.recv.error, res.sent.error)
            assert res.mismatches == 0 and res.stray == 0
            assert metric(d, "kvd_transfers_total", role="consumer", path="local") == 1
    finally:
        assert d.stop() == 0

"""CudaCopier on a real GPU: byte-exact device, peer and host copies, completion seen
through CUDA events. Skips without CUDA (run on a GPU: scripts/gpu_check_local_copy.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvd.errors import TransferError  # noqa: E402
from kvd.transport.copies.cudacopy import HOST, CudaCopier  # noqa: E402

MIB = 1 << 20
BLOCK = 64 << 10
BLOCKS = 256


def shuffled(base: int, rng: np.random.Generator, blocks: int = BLOCKS,
             block: int = BLOCK) -> np.ndarray:
    return rng.permutation(blocks) * block + base


def oracle_blocks(dst_ids: np.ndarray, src_ids: np.ndarray, src: np.ndarray,
                  dst_before: np.ndarray, block: int = BLOCK) -> np.ndarray:
    out = dst_before.copy().reshape(-1, block)
    out[dst_ids] = src.reshape(-1, block)[src_ids]
    return out.reshape(-1)


def random_device_bytes(nbytes: int, device: int, seed: int):
    g = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{device}",
                         generator=g)


@pytest.fixture(params=[{"kernel": True}, {"kernel": False},
                        {"kernel": False, "batch": True}], ids=["kernel", "memcpy", "batch"])
def copier(request):
    try:
        c = CudaCopier(streams_per_device=2, slot_nbytes=1 * MIB, **request.param)
    except TransferError as e:
        pytest.skip(str(e))
    yield c
    c.close()


@pytest.mark.parametrize("align", [1, 8, 16])
def test_gather_kernel_is_byte_exact_at_any_alignment(align):
    """Pieces of odd sizes at offsets aligned to 1, 8 or 16 bytes, shuffled, some larger
    than a kernel chunk: the kernel moves exactly them (oracle: numpy on the host)."""
    rng = np.random.default_rng(align)
    c = CudaCopier(kernel=True)
    try:
        src = random_device_bytes(8 * MIB, 0, align)
        dst = torch.zeros_like(src)
        slots = (8 * MIB) // 200_000  # 41 slots of 200,000 bytes, each holds one piece
        shift = rng.integers(0, 10_000 // align, (2, slots)) * align  # odd for align 1
        d_off = rng.permutation(slots) * 200_000 + shift[0]
        s_off = rng.permutation(slots) * 200_000 + shift[1]
        sizes = rng.integers(1, 190_000 // align, slots) * align
        h = c.post(d_off + dst.data_ptr(), s_off + src.data_ptr(), sizes, dst_devs=0,
                   src_devs=0)
        assert c.wait(h, timeout_s=60)
        c.release(h)
        assert c.kernel_error is None and c._kernels, "the copy did not take the kernel"
        want = oracle_pieces(dst.cpu().numpy() * 0, src.cpu().numpy(), d_off, s_off, sizes)
        np.testing.assert_array_equal(dst.cpu().numpy(), want)
    finally:
        c.close()


def oracle_pieces(dst: np.ndarray, src: np.ndarray, d_off, s_off, sizes) -> np.ndarray:
    out = dst.copy()
    for a, b, k in zip(d_off.tolist(), s_off.tolist(), sizes.tolist(), strict=True):
        out[a:a + k] = src[b:b + k]
    return out


def test_device_to_device_same_gpu(copier):
    rng = np.random.default_rng(1)
    src = random_device_bytes(BLOCKS * BLOCK, 0, 1)
    dst = torch.zeros_like(src)
    d_ids, s_ids = rng.permutation(BLOCKS), rng.permutation(BLOCKS)
    h = copier.post(d_ids * BLOCK + dst.data_ptr(), s_ids * BLOCK + src.data_ptr(),
                    np.full(BLOCKS, BLOCK), dst_devs=0, src_devs=0)
    assert copier.wait(h, timeout_s=60)
    copier.release(h)
    want = oracle_blocks(d_ids, s_ids, src.cpu().numpy(), np.zeros(BLOCKS * BLOCK, np.uint8))
    np.testing.assert_array_equal(dst.cpu().numpy(), want)
    assert copier.counts().handles == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_peer_copy_between_two_gpus(copier):
    rng = np.random.default_rng(2)
    src = random_device_bytes(BLOCKS * BLOCK, 0, 2)
    dst = torch.zeros(BLOCKS * BLOCK, dtype=torch.uint8, device="cuda:1")
    d_ids, s_ids = rng.permutation(BLOCKS), rng.permutation(BLOCKS)
    h = copier.post(d_ids * BLOCK + dst.data_ptr(), s_ids * BLOCK + src.data_ptr(),
                    np.full(BLOCKS, BLOCK), dst_devs=1, src_devs=0)
    assert copier.wait(h, timeout_s=60)
    copier.release(h)
    assert [lane.kind for lane in copier.last_lanes] == ["peer"]
    want = oracle_blocks(d_ids, s_ids, src.cpu().numpy(), np.zeros(BLOCKS * BLOCK, np.uint8))
    np.testing.assert_array_equal(dst.cpu().numpy(), want)


@pytest.mark.parametrize("pinned", [False, True], ids=["staged", "registered"])
def test_device_to_host_and_back(copier, pinned):
    """VRAM producer -> DRAM consumer and the reverse, through staging slots (1 MiB,
    so 16 MiB takes many) or direct into registered memory."""
    rng = np.random.default_rng(3)
    src = random_device_bytes(BLOCKS * BLOCK, 0, 3)
    host = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
    if pinned:
        copier.register_host(host.ctypes.data, host.nbytes)
    d_ids, s_ids = rng.permutation(BLOCKS), rng.permutation(BLOCKS)
    h = copier.post(d_ids * BLOCK + host.ctypes.data, s_ids * BLOCK + src.data_ptr(),
                    np.full(BLOCKS, BLOCK), dst_devs=HOST, src_devs=0)
    # Completion is what the events say: read the host bytes right after poll says
    # done, with no CUDA call in between.
    while not copier.poll(h):
        pass
    want = oracle_blocks(d_ids, s_ids, src.cpu().numpy(), np.zeros(BLOCKS * BLOCK, np.uint8))
    np.testing.assert_array_equal(host, want)
    copier.release(h)
    assert [lane.staged for lane in copier.last_lanes] == [not pinned]
    # and back: host -> a fresh device buffer
    back = torch.zeros_like(src)
    h = copier.post(np.arange(BLOCKS) * BLOCK + back.data_ptr(),
                    np.arange(BLOCKS) * BLOCK + host.ctypes.data, np.full(BLOCKS, BLOCK),
                    dst_devs=0, src_devs=HOST)
    assert copier.wait(h, timeout_s=60)
    copier.release(h)
    np.testing.assert_array_equal(back.cpu().numpy(), host)
    if pinned:
        copier.unregister_host(host.ctypes.data)
        assert copier.counts().registered_host_regions == 0


def test_release_of_a_running_copy_waits_for_it(copier):
    src = random_device_bytes(512 * MIB, 0, 4)
    dst = torch.zeros_like(src)
    n = 256
    block = src.numel() // n
    h = copier.post(np.arange(n)[::-1] * block + dst.data_ptr(),
                    np.arange(n) * block + src.data_ptr(), np.full(n, block),
                    dst_devs=0, src_devs=0)
    copier.release(h)  # returns only once the events completed
    assert copier.counts().handles == 0
    torch.cuda.synchronize()
    assert torch.equal(dst.view(n, block).flip(0), src.view(n, block))


def test_unknown_handle_and_unregister_while_copies_live(copier):
    with pytest.raises(TransferError, match="unknown"):
        copier.poll(12345)
    host = np.zeros(MIB, dtype=np.uint8)
    copier.register_host(host.ctypes.data, host.nbytes)
    src = random_device_bytes(MIB, 0, 5)
    h = copier.post([host.ctypes.data], [src.data_ptr()], [MIB], dst_devs=HOST, src_devs=0)
    with pytest.raises(TransferError, match="not yet released"):
        copier.unregister_host(host.ctypes.data)
    copier.wait(h)
    copier.release(h)
    copier.unregister_host(host.ctypes.data)


@pytest.mark.parametrize("align", [1, 8, 16])
@pytest.mark.parametrize("n_ids", [1, 37])
def test_block_kernel_is_byte_exact(align, n_ids):
    """Block copies (ids over a table, addresses made on the GPU): rows of odd sizes at
    offsets aligned to 1, 8 or 16 bytes, some longer than a chunk, shuffled ids, one id
    (kernel arguments) or many (uploaded); oracle: the expanded pieces, on the host."""
    from kvd.planner.blocks import BlockCopy, BlockTable

    rng = np.random.default_rng(100 + align + n_ids)
    blocks, rows = 48, 5
    sizes = rng.integers(1, 90_000 // align, rows) * align
    seg = int(sizes.max()) + 64
    src = random_device_bytes(blocks * rows * seg + 64, 0, align)
    dst = torch.zeros_like(src)
    j = np.arange(rows)
    shift = rng.integers(0, 32 // align if align < 32 else 1, (2, rows)) * align
    table = BlockTable(dst.data_ptr() + j * blocks * seg + shift[0],
                       src.data_ptr() + j * seg + shift[1], sizes, np.full(rows, seg),
                       np.full(rows, rows * seg), 0, 0, blocks, blocks)
    bc = BlockCopy(table, rng.permutation(blocks)[:n_ids], rng.permutation(blocks)[:n_ids])
    c = CudaCopier()
    try:
        assert c.wait_kernels(120), c.kernel_error
        h = c.post_blocks(bc)
        assert c.last_block_path == "kernel"
        assert c.wait(h, timeout_s=60)
        c.release(h)
        d, s, n, _, _ = bc.expand()
        want = oracle_pieces(np.zeros(src.numel(), np.uint8), src.cpu().numpy(),
                             d - dst.data_ptr(), s - src.data_ptr(), n)
        np.testing.assert_array_equal(dst.cpu().numpy(), want)
        assert all(v > 0 for v in c.kernel_compile_s.values())
    finally:
        c.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_block_kernel_rows_on_two_gpus():
    from kvd.planner.blocks import BlockCopy, BlockTable

    src = random_device_bytes(64 * BLOCK, 0, 9)
    dsts = [torch.zeros(64 * BLOCK, dtype=torch.uint8, device=f"cuda:{i}") for i in (0, 1)]
    table = BlockTable([dsts[0].data_ptr(), dsts[1].data_ptr()],
                       [src.data_ptr(), src.data_ptr()], [BLOCK, BLOCK], [BLOCK, BLOCK],
                       [BLOCK, BLOCK], [0, 1], 0, 64, 64)
    rng = np.random.default_rng(9)
    d_ids, s_ids = rng.permutation(64)[:20], rng.permutation(64)[:20]
    c = CudaCopier()
    try:
        assert c.wait_kernels(120), c.kernel_error
        h = c.post_blocks(BlockCopy(table, d_ids, s_ids))
        assert c.wait(h, timeout_s=60)
        c.release(h)
        for dst in dsts:
            want = oracle_blocks(d_ids, s_ids, src.cpu().numpy(), np.zeros(64 * BLOCK, np.uint8))
            np.testing.assert_array_equal(dst.cpu().numpy(), want)
    finally:
        c.close()

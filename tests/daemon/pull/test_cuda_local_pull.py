"""Both engines on one ``kvd serve --device cuda``: a pull between their VRAM pools is a
copy the daemon issues on the GPU, byte-exact for heterogeneous TP both ways and for a
hybrid (attention + sliding window + Mamba) model. Skips without a CUDA GPU.

The checks are the DRAM suite's own (tests/daemon/pull/test_matrix.py cases through
``run_transfer``, test_hybrid.py's ``run_hybrid``): the engines' pools are torch tensors
on the GPU here, so a client wrapper gives each rank a host mirror, writes it to the GPU
before ``publish`` and reads the GPU back when ``done_recving`` arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from support.cluster import Pair, metric, run_transfer, start_daemon, stop_and_check_clean
from support.hybrid_cases import CASES as HYBRID_CASES
from support.hybrid_cases import run_hybrid, spec
from support.matrix_cases import CASES

from kvd.pool.mapping import numpy_dtype


def _gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(not _gpu(), reason="no CUDA GPU on this machine: local VRAM "
                                 "pulls untested here")]


@dataclass
class _Mirrored:
    """A rank whose ``kv`` is a host copy of its VRAM pool."""

    rank: Any
    kv: np.ndarray

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rank, name)

    def _device_bytes(self) -> Any:
        import torch

        kv = self.rank.kv
        kv = torch.from_numpy(kv) if isinstance(kv, np.ndarray) else kv
        if kv.is_cuda:
            torch.cuda.synchronize()
        return kv.reshape(-1).view(torch.uint8)

    def push(self) -> None:
        import torch

        self._device_bytes().copy_(torch.from_numpy(self.kv.reshape(-1).view(np.uint8)))
        self._device_bytes()  # synchronised: the bytes are on the device

    def pull(self) -> None:
        self.kv.reshape(-1).view(np.uint8)[:] = self._device_bytes().cpu().numpy()


class MirrorClient:
    """KvdClient with host mirrors of VRAM pools (see the module's docstring)."""

    def __init__(self, client: Any, dram: bool = False) -> None:
        self.client = client
        self.dram = dram  # register DRAM pools (device_index -1) instead of VRAM ones
        self.ranks: dict[str, list[_Mirrored]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def register(self, engine_id: str, *args: Any, **kwargs: Any) -> _Mirrored:
        if self.dram:
            kwargs["device_index"] = -1
        rank = self.client.register(engine_id, *args, **kwargs)
        h = rank.pool.handle
        # the memory asked for, or this test proves nothing
        assert h.kind == ("shm" if self.dram else "cuda_ipc"), h.kind
        host = np.zeros(tuple(h.shape), dtype=numpy_dtype(h.dtype))
        m = _Mirrored(rank, host)
        m.push()  # a fresh pool is all zeros: the stray-byte check relies on it
        self.ranks.setdefault(engine_id, []).append(m)
        return m

    def deregister(self, rank: Any) -> None:
        self.client.deregister(rank.rank if isinstance(rank, _Mirrored) else rank)

    def publish(self, engine_id: str, *args: Any, **kwargs: Any) -> Any:
        for m in self.ranks.get(engine_id, []):
            m.push()
        return self.client.publish(engine_id, *args, **kwargs)

    def wait(self, engine_id: str, request_id: str, kind: str, **kwargs: Any) -> Any:
        ev = self.client.wait(engine_id, request_id, kind, **kwargs)
        if kind == "done_recving":
            for m in self.ranks.get(engine_id, []):
                m.pull()
        return ev


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, MirrorClient]]:
    d = start_daemon(tmp_path_factory.mktemp("kvd-logs"), "cuda1", ["--device", "cuda"])
    c = d.client(timeout_s=60)
    try:
        yield d, MirrorClient(c)
    finally:
        c.close()
        stop_and_check_clean(d)


GPU_CASES = ["homogeneous-tp2-tp2", "decode-tp-larger-1-2", "prefill-tp-larger-4-2",
             "gqa-k2-4-1", "mla-4-1", "block-ratio-16-32", "tp2pp1-tp1pp3-10-layers",
             "prefix-hit-tail-only"]


@pytest.mark.parametrize("case", GPU_CASES)
def test_local_vram_pull_is_byte_exact(one, case: str) -> None:
    d, c = one
    copied = metric(d, "kvd_transfers_total", role="consumer", path="local")
    m, pshape, dshape, tokens, skip = CASES[case]
    res = run_transfer(d, d, c, c, m, pshape, dshape, tokens, skip_tokens=skip, timeout_s=60)
    assert res.recv.ok, res.recv.error
    assert res.recv.invalid_block_ids == [] and res.recv.nbytes > 0
    assert res.mismatches == 0
    assert res.stray == 0, "bytes landed outside the pulled blocks"
    assert res.sent.ok, res.sent.error  # the hold released once the copy's event fired
    assert metric(d, "kvd_transfers_total", role="consumer", path="local") == copied + 1
    assert metric(d, "kvd_transfers_total", role="consumer", path="remote") == 0


def test_tp1_to_tp1_contiguous_and_shuffled(one) -> None:
    d, c = one
    m, pshape, dshape, tokens, _ = CASES["homogeneous-tp2-tp2"]
    p1, d1 = replace(pshape, tp_size=1), replace(dshape, tp_size=1)
    for ids in (None, (list(range(16)), list(range(16)))):
        res = run_transfer(d, d, c, c, m, p1, d1, tokens, block_ids=ids, timeout_s=60)
        assert res.recv.ok and res.sent.ok, (res.recv.error, res.sent.error)
        assert res.mismatches == 0 and res.stray == 0


@pytest.mark.parametrize("case", ["tp4-tp1", "tp1-tp4", "tp2-tp4"])
def test_local_vram_hybrid_pull_is_byte_exact(one, case: str) -> None:
    d, c = one
    pshape, dshape, tokens, skip = HYBRID_CASES[case]
    recv, sent, bad = run_hybrid(Pair(d, d, c, c), spec(), pshape, dshape, tokens,
                                 skip_logical=skip)
    assert recv.ok, recv.error
    assert sent.ok, sent.error
    assert bad == 0


@pytest.mark.parametrize("direction", ["vram-to-dram", "dram-to-vram"])
@pytest.mark.parametrize("case", ["decode-tp-larger-1-2", "prefill-tp-larger-4-2"])
def test_local_pull_between_vram_and_dram_pools(one, direction: str, case: str) -> None:
    """A DRAM engine (device_index -1) beside a VRAM one on the same daemon: the pull is
    a device<->host copy the daemon issues (staged), byte-exact, never the network."""
    d, c = one
    dram = MirrorClient(c.client, dram=True)
    pc, dc = (c, dram) if direction == "vram-to-dram" else (dram, c)
    copied = metric(d, "kvd_transfers_total", role="consumer", path="local")
    m, pshape, dshape, tokens, skip = CASES[case]
    res = run_transfer(d, d, pc, dc, m, pshape, dshape, tokens, skip_tokens=skip, timeout_s=60)
    assert res.recv.ok, res.recv.error
    assert res.sent.ok, res.sent.error
    assert res.mismatches == 0 and res.stray == 0
    assert metric(d, "kvd_transfers_total", role="consumer", path="local") == copied + 1
    assert metric(d, "kvd_transfers_total", role="consumer", path="remote") == 0

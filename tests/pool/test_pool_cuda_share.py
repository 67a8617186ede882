"""A VRAM pool is exported at creation: memory no other process can map is refused with
one line at registration. Runs without a GPU (a stand-in for torch's CUDA calls)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

import kvd.pool.cuda as cuda
from kvd.errors import KvdError


class _Storage:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.calls = 0

    def _share_cuda_(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return (0, b"ipc", 2 << 20, 0, b"ref", 0, b"ev", False)


class _Tensor:
    def __init__(self, storage: _Storage) -> None:
        self.storage = storage

    def untyped_storage(self) -> _Storage:
        return self.storage

    def data_ptr(self) -> int:
        return 0x7F0000000000


def _fake_torch(monkeypatch, storage: _Storage) -> None:
    fake = SimpleNamespace(uint8="uint8", cuda=SimpleNamespace(device_count=lambda: 1),
                           zeros=lambda *a, **k: _Tensor(storage))
    monkeypatch.setattr(cuda, "_torch", lambda: fake)


def test_unshareable_memory_is_refused_in_one_line(monkeypatch):
    _fake_torch(monkeypatch, _Storage(RuntimeError(
        "expandable segments do not support IPC\nstack trace line")))
    with pytest.raises(KvdError) as err:
        cuda.CudaPool.create("kvd-t", 1 << 20, 0)
    msg = str(err.value)
    assert "\n" not in msg
    assert "cannot be shared" in msg and "expandable segments do not support IPC" in msg
    assert "PYTORCH_CUDA_ALLOC_CONF" in msg


def test_the_handle_is_the_one_exported_at_creation(monkeypatch):
    storage = _Storage(None)
    _fake_torch(monkeypatch, storage)
    pool = cuda.CudaPool.create("kvd-t", 1 << 20, 0)
    h = pool.handle((4, 4), "bfloat16")
    assert storage.calls == 1  # exported once, when the pool was made
    assert h.kind == "cuda_ipc" and h.nbytes == 1 << 20
    assert msgspec.msgpack.decode(h.ipc_handle)[1] == b"ipc"

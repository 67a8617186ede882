"""VRAM pools: kvd allocates on the rank's GPU and exports a CUDA IPC handle.

The daemon owns the allocation (so NIXL may register it as VRAM); the engine
opens the IPC handle and gets a torch tensor over the same device memory.
Both containers must see the same GPU and share the host IPC/process
namespace (see docs/operations.md). Tested on an H200
(tests/pool/test_cuda_pool.py, which skips where torch.cuda is unavailable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvd.errors import KvdError
from kvd.wire.protocol import PoolHandle

MiB = 1 << 20


def torch_segment_nbytes(nbytes: int) -> int:
    """What torch's CUDA caching allocator asks a pluggable allocator for when one tensor
    of ``nbytes`` is made inside a MemPool (c10's ``get_allocation_size``): 2 MiB up to
    1 MiB, 20 MiB below 10 MiB, else a multiple of 2 MiB. vLLM's KV allocation is served
    from kvd's pool only if the pool holds that much, so pools are allocated this big."""
    if nbytes <= MiB:
        return 2 * MiB
    if nbytes < 10 * MiB:
        return 20 * MiB
    return -(-nbytes // (2 * MiB)) * (2 * MiB)


def _torch() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise KvdError("device='cuda' needs a CUDA GPU visible to kvd (torch.cuda is unavailable)")
    return torch


@dataclass
class CudaPool:
    """Same surface as ShmPool: addr, nbytes, name, handle(), close()."""

    name: str
    nbytes: int
    device_index: int
    tensor: Any
    shared: list[Any] | None = None  # the CUDA IPC handle's fields (_share_cuda_)

    @property
    def addr(self) -> int:
        return int(self.tensor.data_ptr())

    @classmethod
    def create(cls, prefix: str, nbytes: int, device_index: int) -> CudaPool:
        torch = _torch()
        if not 0 <= device_index < torch.cuda.device_count():
            raise KvdError(f"device_index {device_index} not visible "
                           f"({torch.cuda.device_count()} GPUs)")
        # The allocation may be larger than the layout (torch_segment_nbytes); NIXL
        # registers and the engine addresses the first nbytes.
        tensor = torch.zeros(torch_segment_nbytes(nbytes), dtype=torch.uint8,
                             device=f"cuda:{device_index}")
        # Exported now, at registration: memory another process cannot map (an allocator
        # configured for expandable segments without IPC, say) is refused here with one
        # line, never handed out to fail later or fall back to a slow path.
        try:
            shared = list(tensor.untyped_storage()._share_cuda_())
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or its own
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            del tensor
            raise KvdError(f"the VRAM pool on cuda:{device_index} cannot be shared with the "
                           f"engine over CUDA IPC ({first}); check PYTORCH_CUDA_ALLOC_CONF in "
                           "kvd's environment (no expandable_segments)") from None
        return cls(name=f"{prefix}-cuda{device_index}-{tensor.data_ptr():x}", nbytes=nbytes,
                   device_index=device_index, tensor=tensor, shared=shared)

    def handle(self, shape: tuple[int, ...], dtype: str) -> PoolHandle:
        shared = self.shared if self.shared is not None else list(
            self.tensor.untyped_storage()._share_cuda_())
        return PoolHandle(kind="cuda_ipc", name=self.name, nbytes=self.nbytes, shape=list(shape),
                          dtype=dtype, ipc_handle=msgspec.msgpack.encode(shared),
                          device_index=self.device_index)

    def close(self) -> None:
        self.tensor = None


@dataclass
class MappedCudaPool:
    handle: PoolHandle
    storage: Any
    array: Any  # torch tensor shaped by the layout

    def tensor(self) -> Any:
        return self.array

    def capacity_nbytes(self) -> int:
        """The whole allocation the daemon made (at least ``handle.nbytes``)."""
        return int(self.storage.nbytes())

    def adoption_handle(self) -> PoolHandle:
        """As is: a restarted daemon refuses VRAM adoption (designed only,
        docs/operations.md)."""
        return self.handle

    def close(self) -> None:
        self.array = None
        self.storage = None


def open_cuda_pool(handle: PoolHandle) -> MappedCudaPool:
    torch = _torch()
    args = msgspec.msgpack.decode(handle.ipc_handle)
    # _new_shared_cuda is the C entry point, which does not initialise CUDA itself: in a
    # process that has not touched CUDA yet it segfaults (seen on an H200). torch's own
    # rebuild_cuda_tensor initialises first, as here.
    torch.cuda.init()
    with torch.cuda.device(handle.device_index):
        storage = torch.UntypedStorage._new_shared_cuda(*args)
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle.device_index}")
    flat.set_(storage)
    # The allocation may exceed the layout (torch_segment_nbytes): view the layout's part.
    tensor = flat[:handle.nbytes].view(getattr(torch, handle.dtype)).view(handle.shape)
    return MappedCudaPool(handle=handle, storage=storage, array=tensor)

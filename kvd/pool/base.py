"""What the daemon needs of a pool it owns, whatever memory backs it.

`ShmPool` (DRAM: POSIX shm, memfd, hugetlbfs; kvd.pool.shm) and `CudaPool` (VRAM with a
CUDA IPC handle; kvd.pool.cuda) both satisfy `Pool`; the engine table and the registry
hold pools only through it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvd.wire.protocol import PoolHandle


@runtime_checkable
class Pool(Protocol):
    name: str  # what the engine maps it by (shm name, memfd label, IPC pool name)
    nbytes: int

    @property
    def addr(self) -> int:
        """Its base address in this process (a device pointer for VRAM)."""
        ...

    def handle(self, shape: tuple[int, ...], dtype: str) -> PoolHandle:
        """What the engine needs to map it, viewed with ``shape`` and ``dtype``."""
        ...

    def close(self) -> None:
        """Unmap and free it (only once nothing registered or pinned uses it)."""
        ...

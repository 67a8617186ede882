"""KV pools that kvd owns and engines map.

NIXL registers only memory owned by the registering process, so the daemon
allocates every engine rank's pool and hands out a handle:

* DRAM: a POSIX shared-memory file in /dev/shm, opened directly (not through
  multiprocessing.shared_memory, whose resource tracker unlinks segments when
  an *attaching* process exits).
* VRAM: a torch allocation on the rank's device, exported as a CUDA IPC handle
  (untested here: no GPU on the development machines).

The daemon side (`ShmPool`) creates and unlinks; the engine side
(`map_pool`) only maps.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd.errors import KvdError
from kvd.protocol import DTYPE_NBYTES, PoolHandle

SHM_DIR = Path("/dev/shm")

# numpy has no bfloat16/float8: map those to same-width unsigned ints for byte views.
_NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "int8": np.int8,
    "uint8": np.uint8,
}


def numpy_dtype(dtype: str) -> np.dtype:
    try:
        return np.dtype(_NUMPY_DTYPES[dtype])
    except KeyError:
        raise KvdError(f"unsupported dtype {dtype!r}; known: {sorted(DTYPE_NBYTES)}") from None


# Mappings are rounded up to 2 MiB so that a huge-page filesystem (hugetlbfs, or
# tmpfs mounted with huge=always) can back the pools; see Config.shm_dir.
MAP_ALIGN = 2 * 1024 * 1024


def mapped_nbytes(nbytes: int) -> int:
    return -(-nbytes // MAP_ALIGN) * MAP_ALIGN


@dataclass
class ShmPool:
    """A daemon-owned shared-memory region; ``addr`` is what NIXL registers."""

    name: str
    nbytes: int
    mm: mmap.mmap
    array: np.ndarray  # uint8 view keeping the mapping's address stable
    directory: Path = SHM_DIR

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    @classmethod
    def create(cls, prefix: str, nbytes: int, directory: str | Path = SHM_DIR) -> ShmPool:
        if nbytes <= 0:
            raise KvdError(f"pool size must be > 0 bytes, got {nbytes}")
        directory = Path(directory)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        path = directory / name
        size = mapped_nbytes(nbytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # reserve now: fail here, not on a fault
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    os.unlink(path)
                    raise KvdError(
                        f"cannot allocate {size} bytes in {directory} ({exc.strerror}); "
                        "is it large enough?"
                    ) from None
                os.ftruncate(fd, size)  # filesystems without fallocate
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        array = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
        return cls(name=name, nbytes=nbytes, mm=mm, array=array, directory=directory)

    def handle(self, shape: tuple[int, ...], dtype: str) -> PoolHandle:
        return PoolHandle(kind="shm", name=self.name, nbytes=self.nbytes, shape=list(shape),
                          dtype=dtype, directory=str(self.directory))

    def close(self) -> None:
        """Unmap and unlink. Only call once no READ can touch the region any more."""
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping dies with the process
        try:
            os.unlink(self.directory / self.name)
        except FileNotFoundError:
            pass


def kvd_segments(prefix: str, directory: str | Path = SHM_DIR) -> list[str]:
    """Segments carrying our prefix (leak checks, cleanup tooling)."""
    return sorted(p.name for p in Path(directory).glob(f"{prefix}-*"))


@dataclass
class MappedPool:
    """The engine's view of its pool: ``array`` is a zero-copy numpy view."""

    handle: PoolHandle
    mm: mmap.mmap | None
    array: np.ndarray

    def tensor(self) -> Any:
        """A torch tensor over the same bytes (no copy). Imports torch lazily."""
        import torch

        if self.mm is None:
            raise KvdError("tensor() is only available for shm pools here")
        flat = torch.frombuffer(self.mm, dtype=torch.uint8, count=self.handle.nbytes)
        return flat.view(getattr(torch, self.handle.dtype)).view(self.handle.shape)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass


def map_pool(handle: PoolHandle) -> MappedPool:
    """Engine side: open the pool kvd allocated (shm here; CUDA IPC on GPU nodes)."""
    if handle.kind == "cuda_ipc":
        from kvd.cuda_pool import open_cuda_pool

        return open_cuda_pool(handle)
    if "/" in handle.name or handle.name.startswith("."):
        raise KvdError(f"refusing suspicious shm name {handle.name!r}")
    if not os.path.isabs(handle.directory):
        raise KvdError(f"pool directory must be absolute, got {handle.directory!r}")
    fd = os.open(Path(handle.directory) / handle.name, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, mapped_nbytes(handle.nbytes), mmap.MAP_SHARED,
                       mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    arr = (np.frombuffer(mm, dtype=np.uint8)[:handle.nbytes]
           .view(numpy_dtype(handle.dtype)).reshape(handle.shape))
    return MappedPool(handle=handle, mm=mm, array=arr)

"""Engine side of a pool: map what kvd allocated (`map_pool`), never create or remove.

The daemon side (`kvd.pool.shm.ShmPool`) creates and removes the shared-memory files;
VRAM pools open through CUDA IPC (kvd.pool.cuda).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvd.errors import KvdError
from kvd.wire.protocol import DTYPE_NBYTES, PoolHandle

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


@dataclass
class MappedPool:
    """The engine's view of its pool: ``array`` is a zero-copy numpy view."""

    handle: PoolHandle
    mm: mmap.mmap | None
    array: np.ndarray
    # shm files: an open fd holding a shared flock for as long as we map the pool, so
    # that a new daemon's crash-leftover reaping never deletes memory we still use
    # (kvd.pool.owner.reap_dead_pools takes only files it can lock exclusively). The
    # mmap holds a dup of this fd, so the lock lasts exactly as long as the mapping.
    lock_fd: int | None = None

    def tensor(self) -> Any:
        """A torch tensor over the same bytes (no copy). Imports torch lazily."""
        import torch

        if self.mm is None:
            raise KvdError("tensor() is only available for shm pools here")
        flat = torch.frombuffer(self.mm, dtype=torch.uint8, count=self.handle.nbytes)
        return flat.view(getattr(torch, self.handle.dtype)).view(self.handle.shape)

    def adoption_handle(self) -> PoolHandle:
        """What to ask a restarted daemon to adopt: the handle as is for a file pool
        (the new daemon opens it by name); for a memfd pool, whose daemon and its
        ``/proc/<pid>/fd`` are gone, this process's own fd of it (``lock_fd``), which
        the new daemon opens the way this process opened the old one's
        (kvd.pool.adopt)."""
        if not self.handle.directory.startswith("/proc/") or self.lock_fd is None:
            return self.handle
        return msgspec.structs.replace(self.handle, directory=f"/proc/{os.getpid()}/fd",
                                       name=str(self.lock_fd))

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None


def map_pool(handle: PoolHandle) -> MappedPool:
    """Engine side: open the pool kvd allocated (shm here; CUDA IPC on GPU nodes)."""
    if handle.kind == "cuda_ipc":
        from kvd.pool.cuda import open_cuda_pool

        return open_cuda_pool(handle)
    if "/" in handle.name or handle.name.startswith("."):
        raise KvdError(f"refusing suspicious shm name {handle.name!r}")
    if not os.path.isabs(handle.directory):
        raise KvdError(f"pool directory must be absolute, got {handle.directory!r}")
    path = Path(handle.directory) / handle.name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError as exc:
        hint = ("a memfd pool: the engine must run in kvd's PID namespace "
                "(shareProcessNamespace: true) as kvd's uid; or give kvd a hugetlbfs "
                "shm_dir, or set pool_backing" if handle.directory.startswith("/proc/")
                else "run the engine as kvd's uid")
        raise KvdError(f"cannot open pool {path}: {exc.strerror} ({hint})") from None
    try:
        # The file's size is the mapping kvd made: rounded up to its page size (2 MiB,
        # or a hugetlbfs mount's own), which a hugetlb mapping must be a multiple of.
        size = os.fstat(fd).st_size
        if size < handle.nbytes:
            raise KvdError(f"pool {path} holds {size} bytes, handle says {handle.nbytes}")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(OSError):  # best effort: a filesystem without flock
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    arr = (np.frombuffer(mm, dtype=np.uint8)[:handle.nbytes]
           .view(numpy_dtype(handle.dtype)).reshape(handle.shape))
    return MappedPool(handle=handle, mm=mm, array=arr, lock_fd=fd)

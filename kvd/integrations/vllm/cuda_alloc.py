"""Serve vLLM's CUDA KV allocation from kvd's CUDA IPC pool (untested: no GPU here).

vLLM allocates its KV cache inside ``get_mem_pool_context()``; on CUDA that is
``torch.cuda.use_mem_pool(MemPool(CUDAPluggableAllocator(...)))``, the same
mechanism vLLM's Mooncake store connector uses. The allocator is the tiny C
shim next to this file, compiled on first use with the system C compiler into
``$KVD_CUDA_ALLOC_DIR`` (default: a per-user cache directory).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvd.errors import KvdError

SOURCE = Path(__file__).with_name("cuda_alloc.c")


def build_shim() -> Path:
    out_dir = Path(os.environ.get("KVD_CUDA_ALLOC_DIR",
                                  Path.home() / ".cache" / "kvd"))
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libkvd_cuda_alloc.so"
    if not lib.exists() or lib.stat().st_mtime < SOURCE.stat().st_mtime:
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(SOURCE)],
                           check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise KvdError(f"cannot build kvd's CUDA allocator shim with {cc}: {exc}") from None
    return lib


@contextlib.contextmanager
def cuda_pool_context(pool: Any) -> Iterator[None]:
    """vLLM's one KV allocation inside this context returns kvd's pool pointer."""
    import torch

    region = pool.tensor()
    lib_path = build_shim()
    lib = ctypes.CDLL(str(lib_path))
    # The capacity, not the layout's nbytes: torch asks for a rounded segment
    # (kvd.pool.cuda.torch_segment_nbytes), which the daemon allocated.
    lib.kvd_set_region(ctypes.c_void_p(int(region.data_ptr())),
                       ctypes.c_size_t(pool.capacity_nbytes()))
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(lib_path), "kvd_malloc",
                                                         "kvd_free")
    mem_pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(mem_pool):
        yield
    if not lib.kvd_region_was_served():
        raise KvdError("vLLM did not allocate its KV cache inside kvd's CUDA pool context")

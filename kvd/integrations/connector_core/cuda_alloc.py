"""Serve vLLM's CUDA KV allocation from kvd's CUDA IPC pool.

vLLM allocates its KV cache inside ``get_mem_pool_context()``; on CUDA that is
``torch.cuda.use_mem_pool(MemPool(CUDAPluggableAllocator(...)))``, the same
mechanism vLLM's Mooncake store connector uses. The allocator is the tiny C
shim next to this file, compiled with the system C compiler into
``$KVD_CUDA_ALLOC_DIR`` (default: a per-user cache directory): when a CUDA engine's
connector starts (``KvdConnector.__init__``, before it registers or vLLM allocates),
or ahead of time, at packaging time, with
``python -m kvd.integrations.connector_core.cuda_alloc``. A failed build is one
line at start-up, never a failure in the middle of serving.
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


PREBUILD = "python -m kvd.integrations.connector_core.cuda_alloc"


def shim_path() -> Path:
    out_dir = Path(os.environ.get("KVD_CUDA_ALLOC_DIR", Path.home() / ".cache" / "kvd"))
    return out_dir / "libkvd_cuda_alloc.so"


def build_shim() -> Path:
    """The shim's shared library, built now unless one newer than its source exists.
    A failure is one KvdError line: the compiler, its first error line, and the fix."""
    lib = shim_path()
    if lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime:
        return lib
    cc = os.environ.get("CC", "cc")
    fix = f"install a C compiler (or set CC), or prebuild it with `{PREBUILD}`"
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)],
                       check=True, capture_output=True, text=True, timeout=60)
        tmp.replace(lib)  # atomic: workers starting together never load half a file
    except subprocess.CalledProcessError as exc:
        first = next((ln.strip() for ln in (exc.stderr or "").splitlines() if ln.strip()),
                     f"exit status {exc.returncode}")
        raise KvdError(f"kvd's CUDA allocator shim did not build with {cc} ({first}): "
                       f"{fix}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KvdError(f"kvd's CUDA allocator shim did not build with {cc} ({exc}): "
                       f"{fix}") from None
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


if __name__ == "__main__":  # packaging time: build the shim into $KVD_CUDA_ALLOC_DIR
    print(build_shim())

"""kvd.transport.remote.ucx_heap: malloc hands out zeroed memory once it is applied.

Each case runs in a fresh interpreter: M_PERTURB is process-wide and cannot be undone
cleanly. Heap memory written, freed and allocated again is what UCX's request pool
grows on; 64 KiB is above glibc's per-thread cache and below its mmap threshold, so
it comes from the recycled heap (mmap'd memory is zero anyway).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = r"""
import ctypes, sys
from kvd.transport.remote.ucx_heap import zero_fresh_heap
applied = zero_fresh_heap() if sys.argv[1] == "apply" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, dirty = 64 << 10, 0
for _ in range(20):
    ptrs = [libc.malloc(n) for _ in range(8)]
    for p in ptrs:
        ctypes.memset(p, 0xAB, n)
    for p in ptrs:
        libc.free(p)
    again = [libc.malloc(n) for _ in range(8)]
    dirty += sum(ctypes.string_at(p, n).count(0xAB) for p in again)
    for p in again:
        libc.free(p)
print(applied, dirty)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                         timeout=60).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_malloc_returns_zeroed_memory_once_applied() -> None:
    applied, dirty = _probe("apply")
    assert (applied, dirty) == ("True", 0)
    # Without it the same allocations hand back the bytes written before: what a UCX
    # GET reply request read as its datatype.
    applied, dirty = _probe("leave")
    assert applied == "False" and dirty > 0


def test_opt_out_leaves_the_heap_alone() -> None:
    applied, dirty = _probe("apply", KVD_UCX_ZERO_HEAP="0")
    assert applied == "False" and dirty > 0

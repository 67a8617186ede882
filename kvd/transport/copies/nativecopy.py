"""A batched memcpy in C, compiled on first use, for `kvd.transport.copies.localcopy`.

Why: per descriptor, a Python loop of ``ctypes.memmove`` costs ~0.6 us and re-takes
the GIL (which the daemon's event loop needs) between calls. ``kvd_memcpy_batch``
copies a whole array of descriptors in one ctypes call, GIL released throughout.
Measured on a 2-core VM, 256 MiB of shuffled descriptors, x single-thread memcpy:
4 KiB 0.26 -> 0.50, 16 KiB 0.49 -> 0.67, 128 KiB 0.97 -> 1.05, 2 MiB equal
(docs/notes/2026-11-27-local-copy.md).

How: memcpy_batch.c next to this file is built with the system C compiler (``$CC``,
default ``cc``) into ``$KVD_NATIVE_DIR`` (default ``~/.cache/kvd``), under a name that
carries the source's hash, written to a temporary name first and renamed, so
concurrent daemons never load a half-written library. No compiler (the slim
container image has none): `load_batch_copy` returns None and the copier keeps its
memmove loop, which is correct, only slower for small descriptors.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("kvd.transport")
SOURCE = Path(__file__).with_name("memcpy_batch.c")
BatchCopy = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
_lock = threading.Lock()
_loaded: dict[str, BatchCopy | None] = {}


def _library_path(out_dir: Path) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return out_dir / f"libkvd_memcpy_batch-{digest}.so"


def build(out_dir: Path, cc: str) -> Path:
    """Compile the library unless this source's build is there; raises OSError or
    CalledProcessError when it cannot."""
    lib = _library_path(out_dir)
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)], check=True,
                       capture_output=True, text=True, timeout=60)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load_batch_copy(out_dir: str | None = None, cc: str | None = None) -> BatchCopy | None:
    """The batched copy as ``fn(dst, src, nbytes)`` over contiguous int64 arrays, or
    None (logged once per directory) when it cannot be built or loaded."""
    directory = Path(out_dir or os.environ.get("KVD_NATIVE_DIR")
                     or Path.home() / ".cache" / "kvd")
    compiler = cc or os.environ.get("CC", "cc")
    key = f"{directory}\0{compiler}"
    with _lock:
        if key in _loaded:
            return _loaded[key]
        fn: BatchCopy | None = None
        try:
            lib = ctypes.CDLL(str(build(directory, compiler)))
            if lib.kvd_memcpy_batch_version() != 1:
                raise OSError("unexpected kvd_memcpy_batch version")
            raw = lib.kvd_memcpy_batch
            raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            raw.restype = None

            def fn(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
                if not (dst.dtype == src.dtype == nbytes.dtype == np.int64) or not (
                        dst.flags.c_contiguous and src.flags.c_contiguous
                        and nbytes.flags.c_contiguous) or not len(dst) == len(src) == len(
                        nbytes):
                    raise ValueError("batch copy: three contiguous int64 arrays of one length")
                raw(dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data, len(nbytes))
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            log.warning("batched memcpy unavailable (%s); local copies use ctypes.memmove "
                        "per descriptor", exc)
            fn = None
        _loaded[key] = fn
        return fn

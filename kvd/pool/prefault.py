"""A pool's pages mapped in the daemon ahead of traffic, on a background thread.

Why: the daemon maps each DRAM pool it creates, and a page of that mapping costs a
fault the first time the daemon touches it; the first touch of a tmpfs page also
allocates and zeroes it (``posix_fallocate`` reserves pages, the fault clears them:
~28 µs per 4 KiB page on a 2-core VM). A local pull into blocks that were never
written (every hand-over of a fresh decode engine, until its pool has been used once)
paid that on its path: a 3.2 MB pull into fresh blocks took 55 ms in the daemon
where the same pull into used blocks takes 1-2 ms.

How: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) over the mapping, in chunks of
`CHUNK_NBYTES`, through ctypes (the GIL is released for each call: Python's own
``mmap.madvise`` holds it, and would stall the event loop for the whole pool), on a
thread of its own at the usual priority (not a low one: see `CHUNK_NBYTES`).
Contents are untouched. Another daemon's pool file mapped here read-only (the host
path, kvd.daemon.pull.hostmap) is populated the same way with MADV_POPULATE_READ: its
pages exist, so that costs only this process's page tables (~15 ms per 128 MiB).
A kernel without it: nothing is done (pages fault as before).
`Prefault.stop` ends it within one chunk; a pool stops it before it unmaps.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading

log = logging.getLogger("kvd.pool")

MADV_POPULATE_READ = 22  # a read-only mapping (another daemon's pool file)
MADV_POPULATE_WRITE = 23
# Populating holds the process's mmap lock (shared) for a chunk, and any mmap or munmap
# of another thread (a large allocation of the event loop's) waits for it: chunks are
# small (~7 ms of faults on a slow VM) and the thread runs at the usual priority. At
# nice 19 on a host at load 12-37 it got almost no CPU, held the lock while preempted,
# and the daemon's loop took a batch's pulls 800 ms late.
CHUNK_NBYTES = 1 << 20
_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._CFuncPtr:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = _libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Prefault:
    """Populate ``[addr, addr + nbytes)`` of this process (a page-aligned mapping)."""

    def __init__(self, addr: int, nbytes: int, name: str,
                 advice: int = MADV_POPULATE_WRITE) -> None:
        self.addr, self.nbytes, self.name, self.advice = addr, nbytes, name, advice
        self.done = threading.Event()
        self.populated = 0  # bytes mapped so far
        self.error = ""  # why it stopped short ("" when it did not)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvd-prefault", daemon=True)

    def start(self) -> Prefault:
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """End it (within one chunk) and wait for its thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            madvise = _madvise()
            while self.populated < self.nbytes and not self._stop.is_set():
                n = min(CHUNK_NBYTES, self.nbytes - self.populated)
                if madvise(self.addr + self.populated, n, self.advice) != 0:
                    err = ctypes.get_errno()
                    self.error = os.strerror(err)
                    if err not in (errno.EINVAL, errno.ENOSYS):
                        log.info("pool %s: pages not mapped ahead (%s)", self.name,
                                 self.error)
                    return
                self.populated += n
        except Exception as exc:  # noqa: BLE001 - an optimisation: pages fault as before
            self.error = str(exc)
        finally:
            self.done.set()

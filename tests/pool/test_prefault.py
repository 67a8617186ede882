"""A pool's pages mapped ahead of traffic (kvd.pool.prefault): after it, touching every
page of the pool costs this process no page fault (counted, not timed); stopping it
mid-way ends it within a chunk, and a pool stops it before it unmaps."""

from __future__ import annotations

import mmap
import os
import resource
from pathlib import Path

import numpy as np
import pytest

from kvd.pool.prefault import CHUNK_NBYTES, MADV_POPULATE_READ, Prefault
from kvd.pool.shm import ShmPool

PREFIX = "kvd-prefaulttest"


def _faults() -> int:
    """This thread's page faults so far (minor and major)."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return ru.ru_minflt + ru.ru_majflt


def _write_every_page(a: np.ndarray) -> None:
    a[::4096] = 7


def _read_every_page(a: np.ndarray) -> int:
    return int(a[::4096].sum())


def test_a_prefaulted_pool_is_written_without_a_fault(tmp_path: Path) -> None:
    nbytes = 8 << 20
    fresh = ShmPool.create(PREFIX, nbytes, tmp_path)
    pool = ShmPool.create(PREFIX, nbytes, tmp_path)
    try:
        ahead = pool.prefault_in_background()
        assert ahead.done.wait(60)
        if ahead.error:
            pytest.skip(f"MADV_POPULATE_WRITE unavailable here: {ahead.error}")
        assert ahead.populated == len(pool.mm)
        before = _faults()
        _write_every_page(pool.array)
        assert _faults() - before < 16  # none, give or take the interpreter's own
        # the same pool without it: a fault per page written
        before = _faults()
        _write_every_page(fresh.array)
        assert _faults() - before >= nbytes // 4096 // 2
        assert (pool.array[::4096] == 7).all()  # contents as written, nothing cleared
    finally:
        pool.close()
        fresh.close()


def test_another_daemons_file_is_populated_read_only(tmp_path: Path) -> None:
    nbytes = 8 << 20
    pool = ShmPool.create(PREFIX, nbytes, tmp_path)
    try:
        _write_every_page(pool.array)  # the producer's pages exist
        fd = os.open(pool.directory / pool.name, os.O_RDONLY)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        view = np.frombuffer(mm, dtype=np.uint8)
        try:
            ahead = Prefault(int(view.ctypes.data), nbytes, "t", MADV_POPULATE_READ).start()
            assert ahead.done.wait(60)
            if ahead.error:
                pytest.skip(f"MADV_POPULATE_READ unavailable here: {ahead.error}")
            before = _faults()
            assert _read_every_page(view) == 7 * (nbytes // 4096)
            assert _faults() - before < 16
        finally:
            del view
            mm.close()
            os.close(fd)
    finally:
        pool.close()


def test_closing_a_pool_stops_its_prefault_first(tmp_path: Path) -> None:
    pool = ShmPool.create(PREFIX, 64 * CHUNK_NBYTES, tmp_path)
    ahead = pool.prefault_in_background()
    pool.close()  # at most one chunk later, the thread is gone: never past the unmap
    assert ahead.done.is_set()
    assert not ahead._thread.is_alive()

"""The raw baselines run on the same kind of memory as kvd's pools (the target:
"kvd >= 0.95x the best raw NIXL READ on the same memory"), and leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvd.pool.shm import HUGE_PAGE_NBYTES, PoolBacking, ShmPool, hugepages_free_nbytes
from kvd.tools.bench.raw import alloc_buffer, bench_memcpy


def test_shm_buffers_take_the_backing_a_daemon_would(tmp_path: Path) -> None:
    nbytes = 4 * HUGE_PAGE_NBYTES
    daemon_like = ShmPool.create("probe", nbytes, tmp_path, backing=PoolBacking.AUTO)
    want = daemon_like.backing
    daemon_like.close()
    buf, pool = alloc_buffer("shm", nbytes, str(tmp_path))
    try:
        assert pool.backing is want
        if hugepages_free_nbytes() >= 2 * nbytes:  # hosts with reserved 2 MiB pages
            assert pool.page_nbytes == HUGE_PAGE_NBYTES
        buf[:] = 7
        assert int(buf.sum()) == 7 * nbytes
        assert not any(tmp_path.iterdir()), "the raw buffer left a file"
    finally:
        del buf
        pool.close()


def test_memcpy_reports_which_memory_the_shm_copy_used(tmp_path: Path) -> None:
    out = bench_memcpy(2 * HUGE_PAGE_NBYTES, 1, str(tmp_path))
    assert out["shm_buffers_backing"] in {b.value for b in PoolBacking}
    assert out["shm_buffers_page_nbytes"] in (4096, HUGE_PAGE_NBYTES)
    assert np.isfinite(out["memcpy_gbps_shm"]) and out["memcpy_gbps_shm"] > 0
    assert not any(tmp_path.iterdir())

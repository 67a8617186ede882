"""`kvd bench pages` (kvd.tools.bench.pages) end to end on small buffers: every kind it can run here
reports memcpy and raw NIXL figures, verified (a renamed key once broke it unnoticed)."""

from __future__ import annotations

import pytest

from kvd.tools.bench.pages import bench_pages, render_pages

pytestmark = pytest.mark.nixl


def test_page_kinds_report_every_figure() -> None:
    res = bench_pages(nbytes_mib=4, chunk_kib=64, repeats=1, kinds=("anon", "shm"), rounds=1)
    rows = {r["kind"]: r for r in res["kinds"]}
    assert set(rows) == {"anon", "shm"}
    for row in rows.values():
        assert row["verified"] is True
        for key in ("memcpy_gbps", "nixl_one_gbps", "nixl_chunks_gbps"):
            assert row[key] > 0, (row["kind"], key)
    assert rows["shm"]["ratio_nixl_one_vs_anon_memcpy"] > 0
    assert "nixl 1 desc" in render_pages(res)

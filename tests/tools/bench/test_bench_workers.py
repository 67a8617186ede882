"""kvd bench's workers x size curve: the table, the PNG, and the workers'
targets in the main bench's JSON. Measuring itself is a benchmark, not a test."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.tools.bench.workers import plot_workers, render_workers

MiB = 1 << 20


def _result() -> dict:
    rows = []
    for ids, c in (("random", 1.0), ("contiguous", 1.2)):
        for w, k in ((1, 1.0), (2, 1.4), (4, 1.5)):
            for s in (32, 1024):
                rows.append({"workers": w, "ids": ids, "nbytes": s * MiB,
                             "kvd_gbps": round(5.0 * k * c, 2), "kvd_p50_ms": 3.0,
                             "nixl_single_stream_gbps": 5.0,
                             "ratio_vs_single_stream": round(k * c, 3),
                             "ratio_vs_one_worker": k, "verified": True})
    extra = [{"workers": w, "pull_1block_p50_ms": 1.0, "pull_1block_p99_ms": 2.0,
              "single_pull_gbps": 3.0, "concurrent_pulls": 16, "concurrent_gbps": 3.3,
              "ratio_concurrent_vs_single": 1.1, "verified": True} for w in (1, 2, 4)]
    return {"workers_curve": rows, "workers_small_and_concurrent": extra, "repeats": 3,
            "loadavg_1m_end": 1.0, "seconds": 2.0}


def test_table_has_a_column_per_worker_count_and_a_row_per_size() -> None:
    text = render_workers(_result())
    for needle in ("1 workers", "2 workers", "4 workers", "32 MiB", "1 GiB", "x stream (4w)"):
        assert needle in text
    assert "1.4" in text and "1.5" in text
    # the contiguous case: its own table, after the random one
    random_at = text.index("random block ids")
    contiguous_at = text.index("consecutive block ids")
    assert random_at < contiguous_at
    assert "1.8" in text[contiguous_at:] and "1.8" not in text[random_at:contiguous_at]
    assert "1-block p50 ms" in text and "3.3 (16 pulls)" in text


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_workers(_result(), tmp_path / "workers.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_plot_without_a_curve_and_both_curves_at_once() -> None:
    from typer.testing import CliRunner

    from kvd.tools.bench.cli import bench_app

    res = CliRunner().invoke(bench_app, ["--plot", "x.png"])
    assert res.exit_code == 2 and "--workers-curve" in res.output
    res = CliRunner().invoke(bench_app, ["--curves", "--workers-curve"])
    assert res.exit_code == 2 and "separate runs" in res.output

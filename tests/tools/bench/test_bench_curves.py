"""kvd bench scale curves: size points, the table, the PNG, and a clear message without
matplotlib (the optional ``plot`` extra). Measuring itself is a benchmark, not a test."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest

from kvd.errors import KvdError
from kvd.tools.bench.curves import main, plot, render_curves, size_points

MiB = 1 << 20


def _result() -> dict:
    sizes = [(1, 1.9, 4.0), (4, 5.0, 9.0), (512, 9.5, 15.5)]
    return {
        "geometry": {"kv_layout": "kv_split", "block_nbytes": 2 * MiB}, "shm_dir": "/dev/shm",
        "repeats": 5, "loadavg_1m_end": 0.5, "seconds": 1.0,
        "size_curve": [{"nbytes": b * 2 * MiB, "blocks": b, "kvd_gbps": g, "kvd_p50_ms": 1.0,
                        "nixl_gbps": x, "memcpy_gbps": 24.0, "ratio_kvd_nixl": 0.5,
                        "verified": True} for b, g, x in sizes],
        "concurrency_curve": [{"concurrency": c, "pull_nbytes": 32 * MiB, "kvd_gbps": g,
                               "ratio_vs_single": g / 8} for c, g in [(1, 8.0), (16, 9.0)]],
    }


def test_size_points_reach_the_cap() -> None:
    assert size_points(2 * MiB, 1024) == [1, 4, 16, 64, 256, 512]
    assert size_points(2 * MiB, 1) == [1]
    assert size_points(2 * MiB, 100) == [1, 4, 16, 50]


def test_table_names_every_point() -> None:
    text = render_curves(_result())
    assert "1 GiB" in text and "2 MiB" in text and "32 MiB" in text


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot(_result(), tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(KvdError, match=r"pip install 'kvd\[plot\]'"):
        main(plot_path="/tmp/never-written.png")  # refused before measuring anything

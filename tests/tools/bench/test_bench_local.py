"""`kvd bench`'s local scenario through real `kvd serve` processes: both engines on one
daemon (the pull is a copy there), per copy-thread count, bytes checked, ratios taken
from the alternated memcpy/pull timings it reports, and the 1-block local pull beside
the pull between two daemons."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from kvd.tools.bench.geometry import Geometry
from kvd.tools.bench.local import (
    LOCAL_SCENARIOS,
    alternated_ratios,
    bench_local,
    local_targets,
    local_verified,
)

pytestmark = pytest.mark.nixl


def test_local_scenario_pulls_locally_and_checks_its_bytes(tmp_path: Path) -> None:
    geom = Geometry()
    blocks = 4
    pool = blocks + 2
    rng = random.Random(3)
    p_ids, d_ids = rng.sample(range(pool), blocks), rng.sample(range(pool), blocks)
    res = bench_local(geom, blocks, pool, p_ids, d_ids, repeats=1, latency_pulls=6,
                      log_dir=tmp_path, copy_threads=(1, 2))
    rows = res["rows"]
    assert [(r["name"], r["copy_threads"]) for r in rows] == [
        (s.name, t) for t in (1, 2) for s in LOCAL_SCENARIOS]
    assert all(r["verified"] and r["path"] == "local" for r in rows)
    assert all(r["nbytes"] == blocks * geom.block_nbytes for r in rows)
    for r in rows:  # the figure is the median of the per-pull ratios it ran
        assert r["samples"] == res["repeats"] and len(r["memcpy_ms"]) == r["samples"] + 1
        ratios = alternated_ratios(r["memcpy_ms"], r["local_ms"])
        assert r["ratio_local_memcpy"] == pytest.approx(statistics.median(ratios), abs=2e-3)
        # the copy primitive alone, on the same descriptors
        assert r["copier_gbps"] > 0 and r["ratio_copier_memcpy"] > 0
        assert r["copier_descriptors"] >= 1
    lat = res["latency"]
    assert lat["verified"] is True and lat["samples"] == 6 and lat["copy_threads"] == 2
    assert lat["nbytes"] == geom.block_nbytes
    assert lat["ratio_local_two_daemons_p50"] == pytest.approx(
        lat["local_p50_ms"] / lat["two_daemons_p50_ms"], abs=2e-3)
    assert res["targets"]["met"] == local_targets(res)
    assert local_verified(res)

"""The latency floor of `kvd bench` (kvd.tools.bench.floor): three real processes, real
NIXL READs, every block read arriving intact, and figures a ratio can be taken of."""

from __future__ import annotations

import pytest

from kvd.tools.bench.floor import POOL_BLOCKS, bench_floor

pytestmark = pytest.mark.nixl


def test_floor_reads_every_block_intact_and_reports_its_latency() -> None:
    res = bench_floor(block_nbytes=64 << 10, pulls=8, warmup=4)
    assert res["floor_verified"] is True
    assert res["floor_1block_samples"] == POOL_BLOCKS  # at least every block once
    assert 0 < res["floor_1block_p50_ms"] <= res["floor_1block_p99_ms"]

"""A coarse guard on descriptor build time at the target size (80 layers x 4096 blocks).

The target is 20 ms (benchmarks/bench_planner.py measures it); this only catches a fall
back to per-chunk work or to copying the grid through numpy's ufunc buffers, which cost
several times that. The bound is 5x the target on the best of three, so a loaded machine
does not fail it. Cases: the two slowest shapes of the benchmark (5.2M descriptors each,
a grid whose short last axis cannot be cut, and a token-major head slice).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvd.planner import CacheLayout, RankId, build_read_descriptors
from kvd.planner.plan import Read

LAYERS, BLOCKS, POOL = 80, 4096, 8192
BOUND_MS = 100.0


def _layout(heads: int, kv_layout: str, head_layout: str, bs: int = 16) -> CacheLayout:
    return CacheLayout(LAYERS, POOL * 16 // bs, bs, heads, 128, 2, kv_layout=kv_layout,
                       head_layout=head_layout)


@pytest.mark.parametrize("case", ["cross_layer ratio 64<-16", "BLNHC slice 4/8"])
def test_build_of_80_layers_by_4096_blocks_stays_well_under_100_ms(case):
    rng = np.random.default_rng(0)
    if case.startswith("cross_layer"):
        read = Read(RankId(0, 0), (0, 8), (0, 8), (0, 8), (0, LAYERS))
        local, remote = _layout(8, "cross_layer", "HND", 64), _layout(8, "cross_layer", "HND")
        local_ids = rng.permutation(POOL // 4)[:BLOCKS // 4]
    else:
        read = Read(RankId(0, 0), (4, 8), (0, 4), (4, 8), (0, LAYERS))
        local, remote = _layout(4, "BLNHC", "NHD"), _layout(8, "BLNHC", "NHD")
        local_ids = rng.permutation(POOL)[:BLOCKS]
    remote_ids = rng.permutation(POOL)[:BLOCKS]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        desc = build_read_descriptors(read, local, 0, remote, 0, local_ids, remote_ids)
        best = min(best, time.perf_counter() - t0)
        assert len(desc) == 5_242_880
        del desc
    assert best * 1e3 < BOUND_MS, f"{case}: {best * 1e3:.1f} ms"

"""Posting workers through real NIXL between daemon processes: byte-exact
pulls split over 1, 2 and 4 workers, homogeneous and hetero TP, and a producer killed
mid-pull while a consumer's READs run on two workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cluster import (
    Pair,
    deregister_and_check_freed,
    kill_producer_mid_pulls,
    run_transfer,
    running_pair,
    start_daemon,
)

from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

# 32 KiB per token: 1024 tokens are 32 MiB, split in 8 MiB parts over 4 workers.
MODEL = ModelSpec(name="workers-model", num_kv_heads=8, num_layers=8, head_dim=128)


def shape(tp: int) -> EngineShape:
    return EngineShape(tp_size=tp, block_size_tokens=16, num_blocks=96)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"workers{n}")
def wpair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[int, Pair]]:
    n = request.param
    logs = tmp_path_factory.mktemp(f"kvd-w{n}")
    with running_pair(logs, ["--set", f"posting_workers={n}",
                             "--set", "handshake_timeout_s=2"]) as pair:
        yield n, pair


def _reads(pair: Pair) -> list[int]:
    return [r.reads for r in pair.dc.status().rails]


@pytest.mark.parametrize("tps", [(1, 1), (1, 2), (4, 2)], ids=lambda t: f"tp{t[0]}-tp{t[1]}")
def test_byte_exact_split_over_workers(wpair, tps: tuple[int, int]) -> None:
    n, pair = wpair
    before = _reads(pair)
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, MODEL, shape(tps[0]),
                       shape(tps[1]), 1024, seed=11)
    assert res.recv.ok, res.recv.error
    assert res.recv.nbytes == 32 << 20
    assert res.mismatches == 0 and res.stray == 0
    assert res.sent.ok, res.sent.error
    after = _reads(pair)
    if n == 1:
        assert after == [] == before  # one agent, no workers: as before posting workers
    else:
        assert len(after) == n
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def _nbytes(pair: Pair) -> list[int]:
    return [r.nbytes for r in pair.dc.status().rails]


@pytest.mark.parametrize("layout", ["head_major", "cross_layer", "kv_split"])
@pytest.mark.parametrize("tps", [(1, 1), (2, 1), (1, 2)], ids=lambda t: f"tp{t[0]}-tp{t[1]}")
def test_contiguous_pull_is_spread_over_every_worker_byte_exact(wpair, tps: tuple[int, int],
                                                               layout: str) -> None:
    """Consecutive block ids on both sides: the planner merges them into one descriptor
    per rank pair (TP1 -> TP1 head_major or cross_layer: one descriptor for the whole
    pull), which the split cuts by bytes, so each worker reads its share."""
    n, pair = wpair
    before = _nbytes(pair)
    blocks = 1024 // 16

    def shaped(tp: int) -> EngineShape:
        return EngineShape(tp_size=tp, block_size_tokens=16, num_blocks=96, kv_layout=layout)

    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, MODEL, shaped(tps[0]),
                       shaped(tps[1]), 1024, seed=17,
                       block_ids=(list(range(5, 5 + blocks)), list(range(20, 20 + blocks))))
    assert res.recv.ok, res.recv.error
    assert res.recv.nbytes == 32 << 20
    assert res.mismatches == 0 and res.stray == 0
    assert res.sent.ok, res.sent.error
    if n == 1:
        return
    moved = [a - b for a, b in zip(_nbytes(pair), before, strict=True)]
    assert sum(moved) == 32 << 20, moved
    share = (32 << 20) / n
    for m in moved:  # every worker, in proportion (the cut slack: 1/16 of a part each side)
        assert abs(m - share) <= share / 8 + 1, moved


def test_small_pull_stays_on_worker_zero(wpair) -> None:
    n, pair = wpair
    before = _reads(pair)
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, MODEL, shape(1), shape(1),
                       16)
    assert res.recv.ok and res.mismatches == 0 and res.stray == 0
    after = _reads(pair)
    if n > 1:
        assert after[0] == before[0] + 1 and after[1:] == before[1:]


BIG = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=512)  # 512 KiB/block
REQUESTS = 8  # 64 blocks = 32 MiB each


def test_producer_killed_mid_pull_with_two_workers(wpair, tmp_path: Path) -> None:
    """Pulls split over two workers when the producer dies: each fails once with every
    local block invalid (or, finished before the kill, is exact), nothing stays pinned,
    and the consumer keeps serving."""
    n, pair = wpair
    if n != 2:
        pytest.skip("the failure case runs with two workers")
    victim = start_daemon(tmp_path, "victim")
    try:
        d, _ = kill_producer_mid_pulls(pair.dc, victim, MODEL, BIG, REQUESTS, "wkill", 7)
        # Each pull was reported once: no second completion for any of them.
        extra = pair.dc.poll(d.engine_id, timeout_s=0.5)
        assert not [e for e in extra if e.request_id.startswith("wkill-")], extra
        assert not pair.dc.status().pulls
        deregister_and_check_freed(pair.dc, d)
    finally:
        victim.kill()
        for name in kvd_segments(f"kvd-{victim.name}"):
            (SHM_DIR / name).unlink(missing_ok=True)
    res = run_transfer(pair.prefill, pair.decode, pair.pc, pair.dc, MODEL, shape(1), shape(2),
                       1024, seed=13)
    assert res.recv.ok and res.mismatches == 0 and res.stray == 0

"""The named TP/PP configurations of the planner, with every read written out by hand."""

from __future__ import annotations

import pytest

from kvd.errors import PlanError
from kvd.planner import (
    ModelGeometry,
    Parallelism,
    RankId,
    Read,
    default_partition,
    plan_transfer,
    rank_heads,
    stage_layers,
)


def R(remote_tp, heads, local, remote, layers, remote_pp=0) -> Read:
    return Read(RankId(remote_tp, remote_pp), heads, local, remote, layers)


def reads_by_rank(model, prefill, decode) -> dict[tuple[int, int], list[Read]]:
    plan = plan_transfer(model, prefill, decode)
    return {(r.tp_rank, r.pp_rank): list(v) for r, v in plan.reads.items()}


def consumers(model, prefill, decode) -> dict[str, int]:
    return plan_transfer(model, prefill, decode).to_json()["consumers"]


def test_homogeneous_reads_the_same_rank():
    m = ModelGeometry(8, 32)
    assert reads_by_rank(m, Parallelism(2), Parallelism(2)) == {
        (0, 0): [R(0, (0, 4), (0, 4), (0, 4), (0, 32))],
        (1, 0): [R(1, (4, 8), (0, 4), (0, 4), (0, 32))],
    }


def test_decode_tp_larger_reads_slices_of_one_prefill_rank():
    m = ModelGeometry(8, 4)
    assert reads_by_rank(m, Parallelism(2), Parallelism(4)) == {
        (0, 0): [R(0, (0, 2), (0, 2), (0, 2), (0, 4))],
        (1, 0): [R(0, (2, 4), (0, 2), (2, 4), (0, 4))],
        (2, 0): [R(1, (4, 6), (0, 2), (0, 2), (0, 4))],
        (3, 0): [R(1, (6, 8), (0, 2), (2, 4), (0, 4))],
    }
    assert consumers(m, Parallelism(2), Parallelism(4)) == {"0/0": 2, "1/0": 2}


def test_prefill_tp_larger_gathers_from_several_ranks():
    m = ModelGeometry(8, 4)
    assert reads_by_rank(m, Parallelism(4), Parallelism(2)) == {
        (0, 0): [R(0, (0, 2), (0, 2), (0, 2), (0, 4)), R(1, (2, 4), (2, 4), (0, 2), (0, 4))],
        (1, 0): [R(2, (4, 6), (0, 2), (0, 2), (0, 4)), R(3, (6, 8), (2, 4), (0, 2), (0, 4))],
    }


def test_k24_prefill6_decode4_spans_two_prefill_ranks_at_different_offsets():
    m = ModelGeometry(24, 32)
    L = (0, 32)
    assert reads_by_rank(m, Parallelism(6), Parallelism(4)) == {
        (0, 0): [R(0, (0, 4), (0, 4), (0, 4), L), R(1, (4, 6), (4, 6), (0, 2), L)],
        (1, 0): [R(1, (6, 8), (0, 2), (2, 4), L), R(2, (8, 12), (2, 6), (0, 4), L)],
        (2, 0): [R(3, (12, 16), (0, 4), (0, 4), L), R(4, (16, 18), (4, 6), (0, 2), L)],
        (3, 0): [R(4, (18, 20), (0, 2), (2, 4), L), R(5, (20, 24), (2, 6), (0, 4), L)],
    }
    assert consumers(m, Parallelism(6), Parallelism(4)) == {
        "0/0": 1, "1/0": 2, "2/0": 1, "3/0": 1, "4/0": 2, "5/0": 1,
    }


def test_k12_prefill4_decode6_splits_some_decode_ranks_across_prefill_ranks():
    m = ModelGeometry(12, 2)
    L = (0, 2)
    assert reads_by_rank(m, Parallelism(4), Parallelism(6)) == {
        (0, 0): [R(0, (0, 2), (0, 2), (0, 2), L)],
        (1, 0): [R(0, (2, 3), (0, 1), (2, 3), L), R(1, (3, 4), (1, 2), (0, 1), L)],
        (2, 0): [R(1, (4, 6), (0, 2), (1, 3), L)],
        (3, 0): [R(2, (6, 8), (0, 2), (0, 2), L)],
        (4, 0): [R(2, (8, 9), (0, 1), (2, 3), L), R(3, (9, 10), (1, 2), (0, 1), L)],
        (5, 0): [R(3, (10, 12), (0, 2), (1, 3), L)],
    }


def test_gqa_replicated_on_both_sides_spreads_over_replicas():
    # K=2: prefill ranks 0,1 hold head 0 and 2,3 head 1; decode 0-3 head 0, 4-7 head 1.
    m = ModelGeometry(2, 4)
    L, H0, H1 = (0, 4), (0, 1), (1, 2)
    assert reads_by_rank(m, Parallelism(4), Parallelism(8)) == {
        (0, 0): [R(0, H0, (0, 1), (0, 1), L)],
        (1, 0): [R(1, H0, (0, 1), (0, 1), L)],
        (2, 0): [R(0, H0, (0, 1), (0, 1), L)],
        (3, 0): [R(1, H0, (0, 1), (0, 1), L)],
        (4, 0): [R(2, H1, (0, 1), (0, 1), L)],
        (5, 0): [R(3, H1, (0, 1), (0, 1), L)],
        (6, 0): [R(2, H1, (0, 1), (0, 1), L)],
        (7, 0): [R(3, H1, (0, 1), (0, 1), L)],
    }
    assert set(consumers(m, Parallelism(4), Parallelism(8)).values()) == {2}


def test_prefill_replication_with_prefill_tp_larger_reads_each_head_once():
    # K=4, prefill TP 8: ranks 2h, 2h+1 hold head h. Decode TP 2 holds two heads per rank.
    # vLLM's PR 43151 skipped zero-head ranks wrongly here; every head must come once.
    m = ModelGeometry(4, 4)
    L = (0, 4)
    assert reads_by_rank(m, Parallelism(8), Parallelism(2)) == {
        (0, 0): [R(0, (0, 1), (0, 1), (0, 1), L), R(2, (1, 2), (1, 2), (0, 1), L)],
        (1, 0): [R(4, (2, 3), (0, 1), (0, 1), L), R(6, (3, 4), (1, 2), (0, 1), L)],
    }


def test_mla_spreads_the_latent_cache_over_every_prefill_rank():
    m = ModelGeometry(1, 6, mla=True)
    L, H = (0, 6), (0, 1)
    by_rank = reads_by_rank(m, Parallelism(4), Parallelism(8))
    assert by_rank == {(d, 0): [R(d % 4, H, H, H, L)] for d in range(8)}
    assert consumers(m, Parallelism(4), Parallelism(8)) == {f"{p}/0": 2 for p in range(4)}
    # MLA ignores K: any TP size runs.
    assert len(plan_transfer(ModelGeometry(1, 6, True), Parallelism(3), Parallelism(5)).reads) == 5


def test_pp_mismatch_splits_reads_at_stage_boundaries():
    # L=10: prefill PP2 -> [0,5),[5,10); decode PP3 default partition [3,4,3] -> [0,3),[3,7),[7,10)
    m = ModelGeometry(8, 10)
    got = reads_by_rank(m, Parallelism(2, 2), Parallelism(2, 3))
    assert got[(0, 0)] == [R(0, (0, 4), (0, 4), (0, 4), (0, 3))]
    assert got[(0, 1)] == [
        R(0, (0, 4), (0, 4), (0, 4), (3, 5), remote_pp=0),
        R(0, (0, 4), (0, 4), (0, 4), (5, 7), remote_pp=1),
    ]
    assert got[(1, 2)] == [R(1, (4, 8), (0, 4), (0, 4), (7, 10), remote_pp=1)]
    assert consumers(m, Parallelism(2, 2), Parallelism(2, 3)) == {
        "0/0": 2, "1/0": 2, "0/1": 2, "1/1": 2,
    }


def test_explicit_layer_partition_is_honoured():
    m = ModelGeometry(2, 10)
    got = reads_by_rank(m, Parallelism(1, 2, (9, 1)), Parallelism(1, 1))
    assert got[(0, 0)] == [
        R(0, (0, 2), (0, 2), (0, 2), (0, 9), remote_pp=0),
        R(0, (0, 2), (0, 2), (0, 2), (9, 10), remote_pp=1),
    ]


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (32, 1, (32,)),
        (10, 3, (3, 4, 3)),  # remainder goes to the stage just before the last
        (11, 4, (3, 3, 3, 2)),  # remainder 3 -> stages -2, -3, -4
        (13, 4, (3, 3, 4, 3)),
        (4, 4, (1, 1, 1, 1)),
    ],
)
def test_default_partition_matches_vllm_get_pp_indices(layers, pp, expected):
    assert default_partition(layers, pp) == expected
    m = ModelGeometry(1, layers)
    assert [stage_layers(m, Parallelism(1, pp), s)[1] for s in range(pp)][-1] == layers


def test_ownership_rules():
    m = ModelGeometry(8, 1)
    assert [rank_heads(m, Parallelism(4), r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [rank_heads(m, Parallelism(16), r)[0] for r in range(16)] == [r // 2 for r in range(16)]
    assert rank_heads(ModelGeometry(8, 1, True), Parallelism(4), 3) == (0, 1)


@pytest.mark.parametrize(
    ("model", "prefill", "decode", "needle"),
    [
        (ModelGeometry(8, 32), Parallelism(3), Parallelism(2), "TP 3 cannot shard 8 KV heads"),
        (ModelGeometry(8, 32), Parallelism(2), Parallelism(3), "decode TP 3"),
        (ModelGeometry(8, 2), Parallelism(2, 3), Parallelism(2), "PP 3 exceeds"),
        (ModelGeometry(8, 4), Parallelism(2, 2, (1, 2)), Parallelism(2), "sums to 3"),
        (ModelGeometry(8, 4), Parallelism(2, 2, (4, 0)), Parallelism(2), "< 1 layer"),
        (ModelGeometry(8, 4), Parallelism(2, 2, (4,)), Parallelism(2), "1 stages"),
        (ModelGeometry(8, 4), Parallelism(0), Parallelism(2), "TP size must be >= 1"),
        (ModelGeometry(0, 4), Parallelism(1), Parallelism(1), "at least 1 KV head"),
    ],
)
def test_bad_configs_are_refused_in_one_line(model, prefill, decode, needle):
    with pytest.raises(PlanError) as info:
        plan_transfer(model, prefill, decode)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_plans_are_cached_per_engine_pair():
    m = ModelGeometry(8, 32)
    assert plan_transfer(m, Parallelism(2), Parallelism(4)) is plan_transfer(
        ModelGeometry(8, 32), Parallelism(2), Parallelism(4)
    )
    with pytest.raises(TypeError):
        plan_transfer(m, Parallelism(2), Parallelism(4)).reads[RankId(0)] = ()  # type: ignore[index]

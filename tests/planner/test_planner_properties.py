"""Property tests over the whole grid: K 1..64, TP 1..16, PP 1..4, MLA."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planner_cases import (
    HEAD_DIM,
    byte_cases,
    pairs,
    ranks,
)
from support.planner_sim import apply_descriptors, fill_pool, global_kv

from kvd.errors import LayoutError, PlanError
from kvd.planner import (
    CacheLayout,
    ModelGeometry,
    Parallelism,
    RankId,
    build_read_descriptors,
    check_parallelism,
    head_holders,
    heads_per_rank,
    plan_transfer,
    rank_heads,
    stage_layers,
)


@settings(max_examples=1000, deadline=None)
@given(pairs())
def test_plan_reads_every_cell_once_from_a_holder(pair):
    model, prefill, decode = pair
    plan = plan_transfer(model, prefill, decode)
    assert set(plan.reads) == set(ranks(decode))
    assert list(plan.consumers) == ranks(prefill)
    targets: Counter[RankId] = Counter()
    for d_rank, reads in plan.reads.items():
        h0, h1 = rank_heads(model, decode, d_rank.tp_rank)
        l0, l1 = stage_layers(model, decode, d_rank.pp_rank)
        cells: Counter[tuple[int, int]] = Counter()
        for read in reads:
            targets[read.remote] += 1
            ph0, ph1 = rank_heads(model, prefill, read.remote.tp_rank)
            pl0, pl1 = stage_layers(model, prefill, read.remote.pp_rank)
            assert ph0 <= read.heads[0] < read.heads[1] <= ph1
            assert pl0 <= read.layers[0] < read.layers[1] <= pl1
            assert read.local_heads == (read.heads[0] - h0, read.heads[1] - h0)
            assert read.remote_heads == (read.heads[0] - ph0, read.heads[1] - ph0)
            for h in range(*read.heads):
                for layer in range(*read.layers):
                    cells[(h, layer)] += 1
        expected = {(h, layer) for h in range(h0, h1) for layer in range(l0, l1)}
        assert set(cells) == expected and set(cells.values()) == {1}
        # Fewest reads: one per distinct holder segment per overlapped prefill stage.
        stages = {stage_layers(model, prefill, r.remote.pp_rank) for r in reads}
        if model.mla:
            segments = 1
        elif prefill.tp_size <= model.num_kv_heads:
            segments = len({h * prefill.tp_size // model.num_kv_heads for h in range(h0, h1)})
        else:
            segments = h1 - h0
        assert len(reads) == segments * len(stages)
    assert {r: plan.consumers[r] for r in plan.consumers if plan.consumers[r]} == dict(targets)


@settings(max_examples=1500, deadline=None)
@given(pairs())
def test_replicas_share_the_load(pair):
    """Greedy least-loaded: within a replica group, loads differ by at most one read."""
    model, prefill, decode = pair
    plan = plan_transfer(model, prefill, decode)
    cells: Counter[RankId] = Counter()
    biggest: Counter[tuple] = Counter()
    groups: dict[tuple, list[RankId]] = {}
    for p_rank in ranks(prefill):
        key = (p_rank.pp_rank, rank_heads(model, prefill, p_rank.tp_rank))
        groups.setdefault(key, []).append(p_rank)
    for reads in plan.reads.values():
        for read in reads:
            cells[read.remote] += read.num_cells
            key = (read.remote.pp_rank, rank_heads(model, prefill, read.remote.tp_rank))
            biggest[key] = max(biggest[key], read.num_cells)
    for key, members in groups.items():
        loads = [cells[m] for m in members]
        assert max(loads) - min(loads) <= biggest[key]
        if prefill.pp_size == 1 and decode.pp_size == 1:
            counts = [plan.consumers[m] for m in members]
            assert max(counts) - min(counts) <= 1


def _layout(model, par, pp_rank, bs, num_blocks, kv_layout, head_layout) -> CacheLayout:
    """head_major has no NHD form (it is refused): an NHD case gives such a side HND."""
    l0, l1 = stage_layers(model, par, pp_rank)
    if kv_layout == "head_major":
        head_layout = "HND"
    return CacheLayout(
        num_layers=l1 - l0, num_blocks=num_blocks, block_size_tokens=bs,
        num_heads=heads_per_rank(model, par), head_dim=HEAD_DIM, dtype_nbytes=4,
        kv_layout=kv_layout, head_layout=head_layout, mla=model.mla,
    )


def run_bytes(model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts, head_layouts, seed):
    """Shard, plan, copy, compare; returns how many reads were refused as head-sliced NHD."""
    rng = np.random.default_rng(seed)
    kv_parts = 1 if model.mla else 2
    num_heads = 1 if model.mla else model.num_kv_heads
    kv = global_kv(model.num_layers, kv_parts, num_tokens, num_heads, HEAD_DIM)
    n_p, n_d = math.ceil(num_tokens / bs_p), math.ceil(num_tokens / bs_d)
    pool_p, pool_d = n_p + 3, n_d + 2
    ids_p = rng.permutation(pool_p)[:n_p]  # one block table per engine, as in vLLM
    ids_d = rng.permutation(pool_d)[:n_d]
    p_pools = {}
    for p_rank in ranks(prefill):
        lay = _layout(model, prefill, p_rank.pp_rank, bs_p, pool_p, kv_layouts[0],
                      head_layouts[0])
        pools_heads = rank_heads(model, prefill, p_rank.tp_rank)
        p_pools[p_rank] = (lay, fill_pool(lay, kv, stage_layers(model, prefill, p_rank.pp_rank),
                                          pools_heads, ids_p))
    plan = plan_transfer(model, prefill, decode)
    refused = 0
    for d_rank, reads in plan.reads.items():
        lay = _layout(model, decode, d_rank.pp_rank, bs_d, pool_d, kv_layouts[1],
                      head_layouts[1])
        d_layers = stage_layers(model, decode, d_rank.pp_rank)
        expected = fill_pool(lay, kv, d_layers, rank_heads(model, decode, d_rank.tp_rank), ids_d)
        actual = np.full(lay.shape, -1, dtype=np.int32)
        written = np.zeros(lay.total_nbytes, dtype=np.int32)
        ok = True
        for read in reads:
            p_lay, p_pool = p_pools[read.remote]
            p_first = stage_layers(model, prefill, read.remote.pp_rank)[0]
            whole = (read.local_heads == (0, lay.num_heads)
                     and read.remote_heads == (0, p_lay.num_heads))
            eff = (lay.effective_head_layout, p_lay.effective_head_layout)
            if eff[0] != eff[1] or ("NHD" in eff and not whole):
                with pytest.raises(LayoutError):
                    build_read_descriptors(read, lay, d_layers[0], p_lay, p_first, ids_d, ids_p)
                refused += 1
                ok = False
                continue
            desc = build_read_descriptors(read, lay, d_layers[0], p_lay, p_first, ids_d, ids_p)
            apply_descriptors(desc, actual, p_pool, written)
        assert written.max(initial=0) <= 1, "a local byte was written twice"
        if ok:
            np.testing.assert_array_equal(actual, expected)
    return refused


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(byte_cases())
def test_bytes_land_where_the_decode_shard_expects(case):
    model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts, nhd, seed = case
    head_layouts = ("NHD", "NHD") if nhd else ("HND", "HND")
    run_bytes(model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts, head_layouts, seed)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(byte_cases(), st.sampled_from(["cross_layer", "head_major"]),
       st.sampled_from(["local", "remote", "both"]), st.booleans())
def test_block_major_layouts_bytes_on_either_side(case, forced, side, nhd):
    """cross_layer or head_major on the decode side, the prefill side or both, against any
    other layout: PP splits, head slices and block-size ratios all land byte-exact."""
    model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts, _, seed = case
    p_layout, d_layout = kv_layouts
    if side in ("remote", "both"):
        p_layout = forced
    if side in ("local", "both"):
        d_layout = forced
    head_layouts = ("NHD", "NHD") if nhd else ("HND", "HND")
    run_bytes(model, prefill, decode, bs_p, bs_d, num_tokens, (p_layout, d_layout),
              head_layouts, seed)


@settings(max_examples=150, deadline=None)
@given(byte_cases())
def test_nhd_whole_head_reads_work_with_equal_tp(case):
    model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts, _, seed = case
    decode = Parallelism(prefill.tp_size, decode.pp_size, decode.layer_partition)
    # head_major is HND only: pairing it with multi-head NHD is a refused transpose
    kv_layouts = tuple("cross_layer" if k == "head_major" else k for k in kv_layouts)
    refused = run_bytes(model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts,
                        ("NHD", "NHD"), seed)
    assert refused == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16))
def test_engines_vllm_cannot_run_are_refused_in_one_line(k, t):
    model = ModelGeometry(k, 8)
    if k % t == 0 or t % k == 0:
        check_parallelism(model, Parallelism(t), "prefill")
        assert len(head_holders(model, Parallelism(t), k - 1)) >= 1
    else:
        with pytest.raises(PlanError) as info:
            plan_transfer(model, Parallelism(t), Parallelism(1))
        assert "\n" not in str(info.value) and f"TP {t}" in str(info.value)

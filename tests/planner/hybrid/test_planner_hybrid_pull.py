"""A whole hybrid pull, byte by byte: attention, sliding-window and Mamba groups together.

Both engines keep vLLM's hybrid pools (one tensor per layer position shared by
every group, Mamba slots of `ratio` attention pages, each engine with its own
ratio), with different TP, PP, kernel block sizes and prefix hits. The oracle
computes which tokens each group must move from the definitions (the decode's
first uncached token, the window's first token still attended, whole kernel
blocks), writes prefill pools with planner_sim.fill_pool (attention) and whole
per-rank arrays (Mamba), replays the descriptors and compares every byte.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planner_sim import apply_descriptors, fill_pool, global_kv

from kvd.errors import LayoutError
from kvd.planner.hybrid.layout import (
    HYBRID_KV_LAYOUTS,
    AttentionGroupLayout,
    build_hybrid_descriptors,
    vllm_rank_layout,
)
from kvd.planner.hybrid.mamba import MambaSpec
from kvd.planner.hybrid.mamba_layout import MambaStateLayout
from kvd.planner.hybrid.plan import AttentionSpec, model_from_pattern, plan_hybrid
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism

PATTERN = "M*S-M*MS"  # groups: Mamba [0,4] [6], attention [1,5], sliding [2,7]
K, HEAD_DIM = 2, 2
SPEC = MambaSpec(num_heads=24, head_dim=2, n_groups=2, d_state=2, conv_kernel=3,
                 conv_dtype_nbytes=4, ssm_dtype_nbytes=4)
# Granite 4.0-H and Falcon-H1 keep one B/C group, replicated on every TP rank
ONE_GROUP = MambaSpec(num_heads=24, head_dim=2, n_groups=1, d_state=2, conv_kernel=4,
                      conv_dtype_nbytes=4, ssm_dtype_nbytes=4)
# The state shapes the vLLM families give kvd (kvd.integrations.connector_core.hybrid numbers
# Falcon-H1's cache layers position-major: each model layer is an (attention, Mamba) pair)
FAMILIES = {
    "nemotron_h": (PATTERN, SPEC),
    "granite_4h": ("MMM*MMM*", ONE_GROUP),  # Mamba groups [0,1] [2,4] [5,6], attention [3,7]
    "falcon_h1": ("*M*M*M", ONE_GROUP),  # attention [0,2,4], Mamba [1,3,5]
    "mamba2": ("MMM", SPEC),  # no attention
}
TPS = [1, 2, 4, 6, 8]  # what K=2, 24 SSM heads and 1 or 2 groups all allow
MAX_TOKENS = 120
LOCAL_FILL, REMOTE_FILL = -2, -1


def model(window: int, family: str = "nemotron_h"):
    pattern, spec = FAMILIES[family]
    return model_from_pattern(pattern, attention=AttentionSpec(K, HEAD_DIM, dtype_nbytes=4),
                              mamba=spec, window_tokens=window)


def stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    # vLLM's default split, restated: L // pp each, remainder to the stages before the last
    part = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        part[-i] += 1
    bounds = np.cumsum([0, *part])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def kv_heads(tp: int, rank: int) -> tuple[int, int]:
    if tp <= K:
        return rank * K // tp, (rank + 1) * K // tp
    return rank * K // tp, rank * K // tp + 1


def mamba_shard(spec: MambaSpec, tp: int, rank: int, conv: np.ndarray, ssm: np.ndarray):
    h = spec.num_heads
    heads = range(rank * h // tp, (rank + 1) * h // tp)
    g = spec.n_groups
    groups = range(rank * g // tp, (rank + 1) * g // tp) if tp <= g else \
        range(rank * g // tp, rank * g // tp + 1)
    p, n = spec.head_dim, spec.d_state
    x_end, b_end = h * p, h * p + g * n
    body = np.concatenate([conv[heads.start * p:heads.stop * p],
                           conv[x_end + groups.start * n:x_end + groups.stop * n],
                           conv[b_end + groups.start * n:b_end + groups.stop * n]])
    return body, ssm[heads.start:heads.stop]


def put_i32(pool: np.ndarray, byte_offset: int, values: np.ndarray) -> None:
    flat = np.ascontiguousarray(values, dtype=np.int32).reshape(-1)
    assert byte_offset % 4 == 0
    pool[byte_offset // 4: byte_offset // 4 + flat.size] = flat


def kernel_ids(ids: list[int], first_logical: int, ratio: int, kbs: int, t0: int, t1: int):
    """Kernel block of every kbs tokens in [t0, t1): logical block t // (kbs*ratio)."""
    lt = kbs * ratio
    return np.array([ids[t // lt - first_logical] * ratio + (t % lt) // kbs
                     for t in range(t0, t1, kbs)], dtype=np.int64)


class Side:
    """One engine: its plan geometry, pools per rank and block ids per group."""

    def __init__(self, m, tp: int, pp: int, kbs: int, num_logical: int,
                 kv_layout: str = "blocks_first"):
        self.m, self.tp, self.pp, self.kbs = m, tp, pp, kbs
        self.par = Parallelism(tp, pp)
        self.stages = stages(len(m.layers), pp)
        self.layouts = {pp_rank: vllm_rank_layout(m, self.par, pp_rank, num_logical, kbs,
                                                  kv_layout=kv_layout)
                        for pp_rank in range(pp)}
        self.ratio = next((g.blocks_per_logical for lay in self.layouts.values()
                           for g in lay.groups if isinstance(g, AttentionGroupLayout)), 1)

    def rank_pool(self, pp_rank: int, fill: int) -> np.ndarray:
        return np.full(self.layouts[pp_rank].end_nbytes // 4 + 4, fill, dtype=np.int32)

    def positions(self, group: int, pp_rank: int) -> tuple[int, int]:
        a, b = self.stages[pp_rank]
        layers = self.m.groups[group].layers
        return sum(i < a for i in layers), sum(i < b for i in layers)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_tp=st.sampled_from(TPS), d_tp=st.sampled_from(TPS),
    p_pp=st.integers(1, 2), d_pp=st.integers(1, 2),
    p_kbs=st.sampled_from([1, 2, 4]), d_kbs=st.sampled_from([1, 2, 4]),
    window=st.sampled_from([1, 3, 7, 50]),
    num_tokens=st.integers(1, MAX_TOKENS),
    hit=st.floats(0, 1),
    kv_layout=st.sampled_from(HYBRID_KV_LAYOUTS),
    data=st.data(),
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_pull_moves_exactly_the_needed_bytes(p_tp, d_tp, p_pp, d_pp, p_kbs, d_kbs, window,
                                                    num_tokens, hit, kv_layout, data, family):
    m = model(window, family)
    spec = m.mamba
    plan = plan_hybrid(m, Parallelism(p_tp, p_pp), Parallelism(d_tp, d_pp))
    n_groups = len(m.groups)
    # every side's logical block spans >= 8 tokens here (the smallest Mamba state over the
    # largest page), so each group names at most MAX_TOKENS / 8 blocks
    num_logical = 2 * n_groups * -(-MAX_TOKENS // 8) + 8
    prod = Side(m, p_tp, p_pp, p_kbs, num_logical, kv_layout)
    cons = Side(m, d_tp, d_pp, d_kbs, num_logical, kv_layout)

    # Block ids: disjoint between groups (they share the pool's bytes), shuffled.
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    ids = {side: iter(rng.permutation(num_logical).tolist()) for side in ("p", "d")}
    remote_ids, local_ids, first_local = [], [], []
    for g in range(n_groups):
        if m.group_kind(g) == "mamba":
            remote_ids.append([next(ids["p"])])
            local_ids.append([next(ids["d"])])
            first_local.append(0)
            continue
        n_r = -(-num_tokens // (p_kbs * prod.ratio))
        n_l = -(-num_tokens // (d_kbs * cons.ratio))
        keep = max(1, round(n_l * (1 - hit)))  # a prefix hit: the decode names its tail
        remote_ids.append([next(ids["p"]) for _ in range(n_r)])
        local_ids.append([next(ids["d"]) for _ in range(keep)])
        first_local.append(n_l - keep)

    # Truth: every group's KV for every token the prefill kernel blocks hold, and
    # every Mamba state; values distinct across groups (offsets) and >= 0.
    pad = -(-num_tokens // p_kbs) * p_kbs
    kv, mamba, offset = {}, {}, 0
    for g, group in enumerate(m.groups):
        if m.group_kind(g) == "mamba":
            n_layers = len(group.layers)
            conv = np.arange(n_layers * spec.conv_channels * spec.state_len).reshape(
                n_layers, spec.conv_channels, spec.state_len) + offset
            offset += conv.size
            ssm = np.arange(n_layers * spec.num_heads * spec.head_dim * spec.d_state).reshape(
                n_layers, spec.num_heads, spec.head_dim, spec.d_state) + offset
            offset += ssm.size
            mamba[g] = (conv, ssm)
        else:
            kv[g] = global_kv(len(group.layers), 2, pad, K, HEAD_DIM) + offset
            offset += kv[g].size

    def write_group(pool, side: Side, rank: RankId, g: int, block_ids: list[int],
                    t0: int, t1: int, first_logical: int) -> None:
        lay = side.layouts[rank.pp_rank].groups[g]
        a, b = side.positions(g, rank.pp_rank)
        if lay is None or a == b:
            return
        if isinstance(lay, MambaStateLayout):
            conv, ssm = mamba[g]
            for pos in range(a, b):
                body, heads = mamba_shard(spec, side.tp, rank.tp_rank, conv[pos], ssm[pos])
                start = (pos - a) * lay.layer_stride_nbytes + block_ids[0] * lay.slot_stride_nbytes
                put_i32(pool, start, body)  # DS: channel-major
                put_i32(pool, start + body.size * 4, heads)  # SSM right after the conv state
            return
        if t0 >= t1:
            return
        kernel = kernel_ids(block_ids, first_logical, side.ratio, side.kbs, t0, t1)
        arr = fill_pool(lay.cache, kv[g][:, :, t0:t1], (a, b), kv_heads(side.tp, rank.tp_rank),
                        kernel)
        region = pool[lay.base_offset_nbytes // 4:][:arr.size]
        mask = arr.reshape(-1) != -1
        region[mask] = arr.reshape(-1)[mask]

    p_pools = {}
    for pp in range(p_pp):
        for tp in range(p_tp):
            rank, pool = RankId(tp, pp), prod.rank_pool(pp, REMOTE_FILL)
            for g in range(n_groups):
                write_group(pool, prod, rank, g, remote_ids[g], 0, pad, 0)
            p_pools[rank] = pool

    min_kbs, max_kbs = min(p_kbs, d_kbs), max(p_kbs, d_kbs)
    copy_end = -(-num_tokens // min_kbs) * min_kbs  # whole kernel blocks on the smaller side
    for rank in plan.decode_ranks:
        pool = cons.rank_pool(rank.pp_rank, LOCAL_FILL)
        expected = pool.copy()
        refused = False
        for g in range(n_groups):
            start = 0
            if m.group_kind(g) != "mamba":
                start = first_local[g] * d_kbs * cons.ratio
                if m.group_kind(g) == "sliding":
                    start = max(start, num_tokens - window + 1)
                start = min(start, num_tokens)
                if start < num_tokens:
                    start = start // max_kbs * max_kbs
                    # the decode's first block starts inside a bigger prefill kernel block
                    refused |= start < first_local[g] * d_kbs * cons.ratio
            stop = copy_end if start < num_tokens else start
            write_group(expected, cons, rank, g, local_ids[g], start, stop, first_local[g])
        written = np.zeros(pool.size * 4, dtype=np.int64)
        for src in plan.sources(rank):
            args = (plan, rank, src, cons.layouts[rank.pp_rank], prod.layouts[src.pp_rank],
                    local_ids, remote_ids, num_tokens)
            if refused:  # refused by every source that serves the group, fine for others
                with contextlib.suppress(LayoutError):
                    build_hybrid_descriptors(*args)
                    continue
                with pytest.raises(LayoutError, match="prefix hit must cover whole prefill"):
                    build_hybrid_descriptors(*args)
                return
            apply_descriptors(build_hybrid_descriptors(*args).merged(), pool, p_pools[src],
                              written)
        assert written.max() <= 1, "a byte was written twice"
        target = np.repeat(expected >= 0, 4)
        assert (written[target] == 1).all() and not written[~target].any()
        np.testing.assert_array_equal(pool, expected)


def test_sliding_window_reads_only_the_window():
    window, num_tokens, kbs = 7, 100, 2
    m = model(window)
    plan = plan_hybrid(m, Parallelism(2), Parallelism(2))
    lay = vllm_rank_layout(m, Parallelism(2), 0, 64, kbs)
    ratio = next(g.blocks_per_logical for g in lay.groups if isinstance(g, AttentionGroupLayout))
    n_logical = -(-num_tokens // (kbs * ratio))
    blocks = [[0] if m.group_kind(g) == "mamba" else list(range(1, 1 + n_logical))
              for g in range(len(m.groups))]
    sliding = next(g for g in range(len(m.groups)) if m.group_kind(g) == "sliding")
    blocks[sliding] = [b + 20 for b in blocks[sliding]]
    desc = build_hybrid_descriptors(plan, RankId(0), RankId(0), lay, lay, blocks, blocks,
                                    num_tokens)
    cache = lay.groups[sliding].cache
    first_token = (num_tokens - window + 1) // kbs * kbs
    tokens = -(-num_tokens // kbs) * kbs - first_token
    per_token = 2 * cache.num_heads * HEAD_DIM * 4  # K and V of the rank's heads
    assert desc.groups[sliding].total_nbytes == cache.num_layers * tokens * per_token
    full = next(g for g in range(len(m.groups)) if m.group_kind(g) == "attention")
    padded = -(-num_tokens // kbs) * kbs
    assert desc.groups[full].total_nbytes == cache.num_layers * padded * per_token


def test_vllm_page_order_reads_a_head_slice_in_one_piece_per_page():
    """In LBHNC a rank's heads of one (layer, kernel page) are one run (K||V side by side);
    in blocks_first K and V of the slice are two runs: half the descriptors with vLLM's order."""
    m, num_tokens, kbs = model(50), 64, 2
    plan = plan_hybrid(m, Parallelism(1), Parallelism(2))
    counts = {}
    for kv_layout in ("LBHNC", "blocks_first"):
        prod = Side(m, 1, 1, kbs, 64, kv_layout)
        cons = Side(m, 2, 1, kbs, 64, kv_layout)
        n_logical = -(-num_tokens // (kbs * prod.ratio))
        # every other logical block: nothing merges across pages
        ids = [[0] if m.group_kind(g) == "mamba" else
               list(range(2 + 2 * n_logical * g, 2 + 2 * n_logical * (g + 1), 2))
               for g in range(len(m.groups))]
        desc = build_hybrid_descriptors(plan, RankId(0), RankId(0), cons.layouts[0],
                                        prod.layouts[0], ids, ids, num_tokens)
        full = next(g for g in range(len(m.groups)) if m.group_kind(g) == "attention")
        counts[kv_layout] = len(desc.groups[full])
        pages = len(m.groups[full].layers) * -(-num_tokens // kbs)
        assert desc.groups[full].total_nbytes == pages * kbs * 2 * HEAD_DIM * 4  # 1 head, K+V
    assert counts["blocks_first"] == 2 * counts["LBHNC"], counts

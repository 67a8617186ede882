"""Hybrid models: the Mamba byte oracle over TP 1..8 x 1..8, and the model description.

The oracle shares no offset arithmetic with kvd.planner.hybrid.mamba_layout: it shards a
global conv state ([x | B | C] channels x state steps) and SSM state (heads x
head_dim x d_state) with its own slicing, writes whole per-rank arrays into
byte pools at the offsets a MambaStateLayout's fields name, replays the
planner's descriptors and compares every byte of every decode pool.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.planner_sim import apply_descriptors

from kvd.errors import LayoutError, PlanError
from kvd.planner.hybrid.layout import (
    HybridRankLayout,
    build_hybrid_descriptors,
    physical_blocks_per_logical,
)
from kvd.planner.hybrid.mamba import MambaSpec, mamba_rank_shape
from kvd.planner.hybrid.mamba_layout import MambaStateLayout
from kvd.planner.hybrid.plan import (
    AttentionSpec,
    HybridModel,
    KVGroup,
    Layer,
    compat_hash,
    model_from_json,
    model_from_pattern,
    plan_hybrid,
    vllm_groups,
)
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism

DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
LOCAL_FILL, REMOTE_FILL = 0x55, 0xAA

# Three shapes cover the grid: groups sharded on every TP, the single group vLLM
# replicates (G == 1), and a shape that refuses TP 3, 5, 6, 7 (heads or groups).
GRID_SPECS = {
    "sharded": MambaSpec(num_heads=840, head_dim=1, n_groups=840, d_state=1, conv_kernel=3,
                         conv_dtype_nbytes=2, ssm_dtype_nbytes=4),
    "replicated": MambaSpec(num_heads=840, head_dim=2, n_groups=1, d_state=2, conv_kernel=4,
                            conv_dtype_nbytes=4, ssm_dtype_nbytes=2),
    "mixed": MambaSpec(num_heads=24, head_dim=2, n_groups=4, d_state=3, conv_kernel=4,
                       conv_dtype_nbytes=2, ssm_dtype_nbytes=2),
}


# ------------------------------------------------------------------ the oracle


def owned(spec: MambaSpec, tp: int, rank: int) -> tuple[range, range]:
    """Heads and groups of a rank, from the rules as stated (not the planner's code)."""
    heads = range(rank * spec.num_heads // tp, (rank + 1) * spec.num_heads // tp)
    g = spec.n_groups
    if g == 0:
        return heads, range(0)
    if tp <= g:
        return heads, range(rank * g // tp, (rank + 1) * g // tp)
    return heads, range(rank * g // tp, rank * g // tp + 1)


def shard(spec: MambaSpec, tp: int, rank: int, conv: np.ndarray, ssm: np.ndarray):
    """A rank's conv state (its x, then its B, then its C channels) and SSM heads."""
    heads, groups = owned(spec, tp, rank)
    p, n = spec.head_dim, spec.d_state
    x_end, b_end = spec.num_heads * p, spec.num_heads * p + spec.n_groups * n
    pieces = [conv[heads.start * p:heads.stop * p]]
    if len(groups):
        pieces.append(conv[x_end + groups.start * n:x_end + groups.stop * n])
        pieces.append(conv[b_end + groups.start * n:b_end + groups.stop * n])
    return np.concatenate(pieces), ssm[heads.start:heads.stop]


def truth(spec: MambaSpec, num_layers: int, num_slots: int, seed: int):
    """Distinct values for every conv element and SSM element of every layer and slot."""
    conv_shape = (num_layers, num_slots, spec.conv_channels, spec.state_len)
    ssm_shape = (num_layers, num_slots, spec.num_heads, spec.head_dim, spec.d_state)
    n_conv = int(np.prod(conv_shape))
    assert n_conv < 2 ** (8 * spec.conv_dtype_nbytes) - 1, "conv values would repeat"
    conv = (np.arange(n_conv, dtype=np.int64) + 1 + seed).reshape(conv_shape)
    conv %= 2 ** (8 * spec.conv_dtype_nbytes)
    ssm = (np.arange(int(np.prod(ssm_shape)), dtype=np.int64) * 7 + 3 + seed).reshape(ssm_shape)
    ssm %= 2 ** (8 * spec.ssm_dtype_nbytes)
    if spec.ssm_dtype_nbytes == 1:
        ssm = ssm % 256
    return conv, ssm


def state_offsets(lay: MambaStateLayout, pos: int, slot: int, conv_nbytes: int) -> tuple[int, int]:
    """Byte offsets of a state's conv and SSM parts, straight from the layout's fields."""
    start = lay.base_offset_nbytes + pos * lay.layer_stride_nbytes + slot * lay.slot_stride_nbytes
    ssm = lay.ssm_offset_nbytes
    if ssm is None:
        ssm = lay.conv_offset_nbytes + conv_nbytes
    return start + lay.conv_offset_nbytes, start + ssm


def put(pool: np.ndarray, offset: int, values: np.ndarray, nbytes: int) -> None:
    raw = np.ascontiguousarray(values.astype(DTYPES[nbytes])).view(np.uint8).reshape(-1)
    pool[offset:offset + raw.size] = raw


def write_state(pool: np.ndarray, lay: MambaStateLayout, pos: int, slot: int,
                conv_rank: np.ndarray, ssm_rank: np.ndarray) -> tuple[int, int, int, int]:
    spec = lay.spec
    body = conv_rank if lay.conv_layout == "DS" else conv_rank.T
    conv_nbytes = conv_rank.size * spec.conv_dtype_nbytes
    c_off, s_off = state_offsets(lay, pos, slot, conv_nbytes)
    put(pool, c_off, body, spec.conv_dtype_nbytes)
    put(pool, s_off, ssm_rank, spec.ssm_dtype_nbytes)
    return c_off, conv_nbytes, s_off, ssm_rank.size * spec.ssm_dtype_nbytes


def layout_variant(spec: MambaSpec, tp: int, layers: int, slots: int, variant: int,
                   conv_layout: str) -> MambaStateLayout:
    """Dense layer-major, slot-major, gapped with SSM first, or vLLM-like padded slots."""
    shape = mamba_rank_shape(spec, tp)
    conv, ssm = shape.conv_nbytes, shape.ssm_nbytes
    extent = conv + ssm
    common = dict(spec=spec, tp_size=tp, num_layers=layers, num_blocks=slots,
                  conv_layout=conv_layout)
    if variant == 0:
        return MambaStateLayout(**common, slot_stride_nbytes=extent,
                                layer_stride_nbytes=slots * extent)
    if variant == 1:
        return MambaStateLayout(**common, slot_stride_nbytes=layers * extent,
                                layer_stride_nbytes=extent)
    if variant == 2:
        stride = 8 + ssm + 16 + conv + 8
        return MambaStateLayout(**common, base_offset_nbytes=32, slot_stride_nbytes=stride,
                                layer_stride_nbytes=slots * stride + 40, ssm_offset_nbytes=8,
                                conv_offset_nbytes=8 + ssm + 16)
    page = -(-extent // 64) * 64 * 3
    return MambaStateLayout(**common, slot_stride_nbytes=page, layer_stride_nbytes=slots * page)


def pool_for(lay: MambaStateLayout, fill: int) -> np.ndarray:
    lay.validate()
    return np.full(lay.end_nbytes + 16, fill, dtype=np.uint8)


MAMBA_PATTERN = "M-MM"  # three Mamba layers (one group) and an MLP layer
SLOTS = 5
LOCAL_SLOTS, REMOTE_SLOTS = [3, 1], [0, 4]


def runnable(spec: MambaSpec, tp: int) -> bool:
    g = spec.n_groups
    return spec.num_heads % tp == 0 and (g == 0 or g % tp == 0 or tp % g == 0)


def run_mamba_oracle(spec: MambaSpec, p_tp: int, d_tp: int, p_variant: int, d_variant: int,
                     conv_layout: str) -> dict[RankId, int]:
    """Replay a pure-Mamba pull and check every decode byte; returns descriptors per rank."""
    model = model_from_pattern(MAMBA_PATTERN, mamba=spec)
    layers = len(model.groups[0].layers)
    plan = plan_hybrid(model, Parallelism(p_tp), Parallelism(d_tp))
    conv, ssm = truth(spec, layers, len(REMOTE_SLOTS), seed=p_tp * 8 + d_tp)

    p_lay = layout_variant(spec, p_tp, layers, SLOTS, p_variant, conv_layout)
    p_pools = {}
    for p in range(p_tp):
        pool = pool_for(p_lay, REMOTE_FILL)
        for pos, (i, slot) in itertools.product(range(layers), enumerate(REMOTE_SLOTS)):
            write_state(pool, p_lay, pos, slot, *shard(spec, p_tp, p, conv[pos, i], ssm[pos, i]))
        p_pools[RankId(p)] = pool

    d_lay = layout_variant(spec, d_tp, layers, SLOTS, d_variant, conv_layout)
    counts = {}
    for d in range(d_tp):
        rank = RankId(d)
        pool = pool_for(d_lay, LOCAL_FILL)
        expected = pool.copy()
        target = np.zeros(pool.size, dtype=bool)
        for pos, (i, slot) in itertools.product(range(layers), enumerate(LOCAL_SLOTS)):
            c_off, c_n, s_off, s_n = write_state(expected, d_lay, pos, slot,
                                                 *shard(spec, d_tp, d, conv[pos, i], ssm[pos, i]))
            target[c_off:c_off + c_n] = True
            target[s_off:s_off + s_n] = True
        written = np.zeros(pool.size, dtype=np.int64)
        counts[rank] = 0
        for src in plan.sources(rank):
            desc = build_hybrid_descriptors(plan, rank, src, HybridRankLayout((d_lay,)),
                                            HybridRankLayout((p_lay,)), [LOCAL_SLOTS],
                                            [REMOTE_SLOTS], num_tokens=0)
            apply_descriptors(desc.merged(), pool, p_pools[src], written)
            counts[rank] += len(desc)
        assert written.max() <= 1, f"decode {d}: a byte was written twice"
        assert (written[target] == 1).all(), f"decode {d}: a state byte was not written"
        assert not written[~target].any(), f"decode {d}: wrote outside its states"
        np.testing.assert_array_equal(pool, expected, err_msg=f"decode {d} of {p_tp}->{d_tp}")
    return counts


@pytest.mark.parametrize("name", sorted(GRID_SPECS))
@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.product(range(1, 9), range(1, 9))))
def test_every_mamba_element_lands_once_in_the_right_decode_rank(name, p_tp, d_tp):
    spec = GRID_SPECS[name]
    if not (runnable(spec, p_tp) and runnable(spec, d_tp)):
        with pytest.raises(PlanError, match=r"(prefill|decode) TP \d+ cannot shard \d+ "
                                            r"(SSM heads|Mamba groups)"):
            plan_hybrid(model_from_pattern(MAMBA_PATTERN, mamba=spec), Parallelism(p_tp),
                        Parallelism(d_tp))
        return
    conv_layout = "DS" if (p_tp + d_tp) % 2 == 0 else "SD"
    run_mamba_oracle(spec, p_tp, d_tp, (p_tp + d_tp) % 4, (p_tp * d_tp + 1) % 4, conv_layout)


# -------------------------------------------------------------- read structure


def test_reads_cover_each_head_and_group_once_from_a_holder():
    for spec, p_tp, d_tp in itertools.product(GRID_SPECS.values(), range(1, 9), range(1, 9)):
        if not (runnable(spec, p_tp) and runnable(spec, d_tp)):
            continue
        plan = plan_hybrid(model_from_pattern(MAMBA_PATTERN, mamba=spec), Parallelism(p_tp),
                           Parallelism(d_tp))
        for d in range(d_tp):
            heads, groups = owned(spec, d_tp, d)
            got_heads, got_groups = [], []
            for read in plan.mamba[RankId(d)]:
                p_heads, p_groups = owned(spec, p_tp, read.remote.tp_rank)
                got_heads += range(*read.heads)
                assert set(range(*read.heads)) <= set(p_heads)
                assert read.heads[0] - heads.start == read.local_heads[0]
                assert read.heads[0] - p_heads.start == read.remote_heads[0]
                if read.groups is not None:
                    got_groups += range(*read.groups)
                    assert set(range(*read.groups)) <= set(p_groups)
                    assert read.groups[0] - groups.start == read.local_groups[0]
                    assert read.groups[0] - p_groups.start == read.remote_groups[0]
            assert sorted(got_heads) == list(heads)
            assert sorted(got_groups) == list(groups)
        assert sum(plan.consumers.values()) == sum(len(plan.sources(r))
                                                   for r in plan.decode_ranks)


NEMOTRON_H_8B = model_from_pattern(
    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    attention=AttentionSpec(num_kv_heads=8, head_dim=128),
    mamba=MambaSpec(num_heads=128, head_dim=64, n_groups=8, d_state=128, conv_kernel=4),
    name="nemotron-h-8b")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 2), (2, 4), (8, 2), (2, 8), (1, 4), (4, 1)])
def test_hetero_tp_is_three_conv_reads_and_one_ssm_read_per_layer_and_source(p_tp, d_tp):
    """Layer-major states, shuffled slots: nothing merges, so the count is exactly 3 + 1."""
    model = model_from_pattern("MMMMMM", mamba=NEMOTRON_H_8B.mamba)
    plan = plan_hybrid(model, Parallelism(p_tp), Parallelism(d_tp))
    spec = model.mamba
    for d in plan.decode_ranks:
        for src in plan.sources(d):
            (read,) = [r for r in plan.mamba[d] if r.remote == src]
            assert read.reads_per_layer == 4
            desc = build_hybrid_descriptors(
                plan, d, src, HybridRankLayout((MambaStateLayout(spec, d_tp, 6, 8),)),
                HybridRankLayout((MambaStateLayout(spec, p_tp, 6, 8),)), [[5, 2]], [[0, 7]], 0)
            assert len(desc) == 4 * 6 * 2


@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
def test_equal_tp_moves_whole_states(conv_layout):
    spec = NEMOTRON_H_8B.mamba
    model = model_from_pattern("MMMMMM", mamba=spec)
    plan = plan_hybrid(model, Parallelism(2), Parallelism(2))
    dense = MambaStateLayout(spec, 2, 6, 8, conv_layout=conv_layout)
    desc = build_hybrid_descriptors(plan, RankId(1), RankId(1), HybridRankLayout((dense,)),
                                    HybridRankLayout((dense,)), [[5]], [[2]], 0)
    assert len(desc) == 6  # conv + SSM of a layer are one run; layers are num_blocks apart
    assert set(desc.groups[0].nbytes.tolist()) == {mamba_rank_shape(spec, 2).state_nbytes}
    slot_major = MambaStateLayout(spec, 2, 6, 8, conv_layout=conv_layout,
                                  slot_stride_nbytes=6 * dense.slot_stride,
                                  layer_stride_nbytes=dense.slot_stride)
    desc = build_hybrid_descriptors(plan, RankId(0), RankId(0), HybridRankLayout((slot_major,)),
                                    HybridRankLayout((slot_major,)), [[3, 4]], [[6, 7]], 0)
    assert len(desc) == 1 and desc.total_nbytes == 2 * 6 * dense.slot_stride


def test_sd_conv_costs_one_run_per_state_step():
    spec = NEMOTRON_H_8B.mamba
    model = model_from_pattern("M", mamba=spec)
    plan = plan_hybrid(model, Parallelism(4), Parallelism(2))
    for conv_layout, per_layer in (("DS", 4), ("SD", 3 * spec.state_len + 1)):
        lay_d = MambaStateLayout(spec, 2, 1, 4, conv_layout=conv_layout)
        lay_p = MambaStateLayout(spec, 4, 1, 4, conv_layout=conv_layout)
        desc = build_hybrid_descriptors(plan, RankId(0), RankId(1), HybridRankLayout((lay_d,)),
                                        HybridRankLayout((lay_p,)), [[1]], [[2]], 0)
        assert len(desc) == per_layer


def test_mismatched_layouts_and_slots_are_refused():
    spec = NEMOTRON_H_8B.mamba
    model = model_from_pattern("M", mamba=spec)
    plan = plan_hybrid(model, Parallelism(1), Parallelism(1))
    ds, sd = MambaStateLayout(spec, 1, 1, 4), MambaStateLayout(spec, 1, 1, 4, conv_layout="SD")
    one = RankId(0)
    with pytest.raises(LayoutError, match="conv state layouts differ"):
        build_hybrid_descriptors(plan, one, one, HybridRankLayout((ds,)), HybridRankLayout((sd,)),
                                 [[0]], [[0]], 0)
    with pytest.raises(LayoutError, match="pair one to one"):
        build_hybrid_descriptors(plan, one, one, HybridRankLayout((ds,)), HybridRankLayout((ds,)),
                                 [[0, 1]], [[0]], 0)
    with pytest.raises(LayoutError, match="out of range"):
        build_hybrid_descriptors(plan, one, one, HybridRankLayout((ds,)), HybridRankLayout((ds,)),
                                 [[4]], [[0]], 0)
    with pytest.raises(LayoutError, match="overlap"):
        MambaStateLayout(spec, 1, 2, 4, slot_stride_nbytes=8).validate()


# ----------------------------------------------------- model, groups and hash


def test_nemotron_h_8b_shape_and_vllm_groups():
    m = NEMOTRON_H_8B
    assert len(m.layers) == 52
    assert len(m.layers_of("mamba")) == 24 and len(m.layers_of("attention")) == 4
    sizes = {len(g.layers) for g in m.groups}
    assert sizes == {min(len(m.layers_of("mamba")), len(m.layers_of("attention")))}
    for g in range(len(m.groups)):
        assert len({m.layers[i].kind for i in m.groups[g].layers}) == 1
    assert sorted(i for g in m.groups for i in g.layers) == sorted(m.layers_of("mamba",
                                                                                "attention"))


def test_vllm_groups_use_the_largest_count_when_counts_are_close():
    layers = tuple(Layer("sliding", 128) if i % 2 else Layer("attention") for i in range(25))
    groups = vllm_groups(layers)  # 13 full and 12 sliding: two groups, not twelve
    assert [len(g.layers) for g in groups] == [13, 12]


def test_json_round_trip_and_short_form():
    again = model_from_json(NEMOTRON_H_8B.to_json())
    assert again == NEMOTRON_H_8B
    short = model_from_json({"pattern": "M*S-", "window_tokens": 64, "name": "x",
                             "attention": {"num_kv_heads": 2, "head_dim": 8},
                             "mamba": {"num_heads": 4, "head_dim": 2, "n_groups": 1,
                                       "d_state": 4, "conv_kernel": 4}})
    assert [layer.kind for layer in short.layers] == ["mamba", "attention", "sliding", "none"]
    assert short.group_window(next(g for g in range(3) if short.group_kind(g) == "sliding")) == 64


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"layers": (Layer("attention"), Layer("none"))}, "no KV-cache group|group"),
        ({"groups": (KVGroup((0, 1)),)}, "does not match"),
        ({"groups": (KVGroup((0,)), KVGroup((0, 1)))}, "in groups"),
        ({"groups": (KVGroup((0,)),)}, "in no KV-cache group"),
        ({"mamba": None}, "no Mamba spec"),
        ({"attention": None}, "no attention spec"),
    ],
)
def test_bad_models_are_refused_naming_the_reason(change, needle):
    base = dict(layers=(Layer("attention"), Layer("mamba")),
                groups=(KVGroup((0,)), KVGroup((1,))), attention=AttentionSpec(2, 8),
                mamba=MambaSpec(4, 2, 1, 4, 4))
    with pytest.raises(PlanError, match=needle):
        HybridModel(**{**base, **change}).validate()


def test_compat_hash_covers_every_field_and_nothing_else():
    base = NEMOTRON_H_8B
    h = compat_hash(base)
    assert h == compat_hash(model_from_json(base.to_json()))
    variants = [
        model_from_pattern("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-MM",
                           attention=base.attention, mamba=base.mamba, name=base.name),
        HybridModel(base.layers, base.groups, AttentionSpec(8, 128, mla=False, dtype_nbytes=1),
                    base.mamba, base.name),
        HybridModel(base.layers, base.groups, AttentionSpec(4, 128), base.mamba, base.name),
        HybridModel(base.layers, base.groups, base.attention,
                    MambaSpec(128, 64, 8, 128, 4, ssm_dtype_nbytes=4), base.name),
        HybridModel(base.layers, base.groups, base.attention, MambaSpec(128, 64, 4, 128, 4),
                    base.name),
        HybridModel(base.layers, base.groups, base.attention, MambaSpec(128, 64, 8, 128, 3),
                    base.name),
        HybridModel(base.layers, base.groups[::-1], base.attention, base.mamba, base.name),
        HybridModel(base.layers, base.groups, base.attention, base.mamba, "other"),
    ]
    hashes = {compat_hash(v) for v in variants}
    assert h not in hashes and len(hashes) == len(variants)
    assert compat_hash(base, conv_layout="SD") != h


# ------------------------------------------------------ physical blocks per logical


def test_seed_ratios_nemotron_30b():
    """The seed's 131 at TP 4 and 261 at TP 1, from Nemotron-3-Nano-30B-A3B's shape.

    Assumptions: 64 SSM heads x 64, 8 groups x 128 state, conv kernel 4, bf16
    conv and fp32 SSM state (its mamba_ssm_cache_dtype), 2 KV heads x 128 bf16,
    and an attention kernel page of 4096 B per KV head held (16-token K pages,
    or 8-token K+V pages); TP 4 replicates one KV head per rank.
    """
    spec = MambaSpec(64, 64, 8, 128, 4, conv_dtype_nbytes=2, ssm_dtype_nbytes=4)
    page_per_head = 4096
    got = {tp: physical_blocks_per_logical(mamba_rank_shape(spec, tp).state_nbytes,
                                           page_per_head * max(1, 2 // tp))
           for tp in (1, 4)}
    assert got == {4: 131, 1: 261}


def test_replicated_groups_spread_over_replicas():
    """P 4 -> D 6 with 2 groups: both sides replicate, and d1 shares p0 with d0.

    Any holder is correct (the oracle grid checks bytes); the planner picks the
    least-loaded one so that one replica does not serve every decode rank's B/C.
    """
    spec = MambaSpec(num_heads=24, head_dim=2, n_groups=2, d_state=2, conv_kernel=4)
    plan = plan_hybrid(model_from_pattern("MM", mamba=spec), Parallelism(4), Parallelism(6))
    served: dict[int, list[int]] = {}
    for rank in plan.decode_ranks:
        for read in plan.mamba[rank]:
            if read.groups is not None:
                served.setdefault(read.groups[0], []).append(read.remote.tp_rank)
    for group, ranks in served.items():
        holders = owned_by(spec, 4, group)
        counts = [ranks.count(p) for p in holders]
        assert max(counts) - min(counts) <= 1, (group, ranks)


def owned_by(spec: MambaSpec, tp: int, group: int) -> list[int]:
    return [p for p in range(tp) if group in owned(spec, tp, p)[1]]


@pytest.mark.parametrize(("mla", "kv_heads"), [(True, 1), (False, 2), (False, 1)])
def test_replicated_attention_comes_from_a_mamba_source(mla, kv_heads):
    """Replicated KV (MLA, K < TP) never adds a prefill rank beyond the Mamba sources."""
    spec = MambaSpec(num_heads=24, head_dim=2, n_groups=2, d_state=2, conv_kernel=4)
    model = model_from_pattern("M*M*", attention=AttentionSpec(kv_heads, 8, mla=mla), mamba=spec)

    def held(tp: int, rank: int) -> range:  # KV heads of a prefill rank, as vLLM shards them
        if mla:
            return range(1)
        if tp <= kv_heads:
            return range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp)
        return range(rank * kv_heads // tp, rank * kv_heads // tp + 1)

    for p_tp, d_tp in itertools.product((1, 2, 4, 8), repeat=2):
        plan = plan_hybrid(model, Parallelism(p_tp), Parallelism(d_tp))
        for rank in plan.decode_ranks:
            assert set(plan.sources(rank)) == {r.remote for r in plan.mamba[rank]}
            for read in plan.attention[rank]:  # still a holder of the heads it reads
                heads = held(p_tp, read.remote.tp_rank)
                assert set(range(*read.heads)) <= set(heads)
                assert read.remote_heads[0] == read.heads[0] - heads.start

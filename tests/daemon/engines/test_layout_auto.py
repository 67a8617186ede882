"""kv_layout "auto": the engine's daemon picks the layout, per model kind.

The rules (kvd.daemon.engines.table.AUTO_LAYOUTS), each checked against the planner's own
descriptor counts: plain HND attention -> head_major, NHD -> cross_layer, MLA ->
cross_layer, hybrid -> LBHNC (NHD: LBNHC). The resolution never depends on TP, PP or
block size, so two engines that may pair resolve alike and their compatibility hashes
match; "auto" itself is never hashed or handed to a peer.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from support.hybrid_sim import HybridShape, hybrid_spec

from kvd.daemon.engines.table import (
    AUTO_LAYOUTS,
    EngineTable,
    auto_kv_layout,
    compat_hash,
    resolve_layout,
    resolve_registration,
    validate_registration,
)
from kvd.errors import LayoutError
from kvd.planner import (
    ModelGeometry,
    Parallelism,
    RankId,
    heads_per_rank,
    plan_transfer,
    stage_layers,
)
from kvd.planner.descriptors import build_read_descriptors
from kvd.planner.hybrid.layout import HYBRID_KV_LAYOUTS, hybrid_head_layout
from kvd.planner.layout import ALL_KV_LAYOUTS, VLLM_LAYOUTS, CacheLayout, vllm_head_layout
from kvd.pool.geometry import HybridPool
from kvd.wire import protocol as P

PLAIN = P.ModelSpec(name="auto-plain", num_kv_heads=8, num_layers=4, head_dim=64)
MLA = P.ModelSpec(name="auto-mla", num_kv_heads=1, num_layers=4, head_dim=96, mla=True)
AUTO = P.LayoutSpec(num_blocks=16, block_size_tokens=16)
HYBRID = hybrid_spec("M*S-M*MS", [[0, 4], [1, 5], [2, 7], [6]], k=2, head_dim=4, window=7,
                     mamba=P.MambaSpecMsg(num_heads=24, head_dim=2, n_groups=2, d_state=4,
                                          conv_kernel=4))


def auto(head_layout: str = "HND", **kw: int) -> P.LayoutSpec:
    return P.LayoutSpec(num_blocks=kw.get("num_blocks", 16),
                        block_size_tokens=kw.get("block_size_tokens", 16),
                        head_layout=head_layout)


def register(model: P.ModelSpec, layout: P.LayoutSpec, tp: int = 1, pp: int = 1,
             tp_rank: int = 0, pp_rank: int = 0) -> P.RegisterEngine:
    return P.RegisterEngine(engine_id="e", model=model, layout=layout, tp_rank=tp_rank,
                            tp_size=tp, pp_rank=pp_rank, pp_size=pp)


# ------------------------------------------------------------ the rules, case by case


def test_auto_is_the_default() -> None:
    assert AUTO.kv_layout == P.AUTO_KV_LAYOUT == "auto" and AUTO.head_layout == "HND"


@pytest.mark.parametrize(("model", "head_layout", "expected"), [
    (PLAIN, "HND", "head_major"),
    (PLAIN, "NHD", "cross_layer"),
    (MLA, "HND", "cross_layer"),
    (MLA, "NHD", "cross_layer"),
    (HYBRID, "HND", "LBHNC"),
    (HYBRID, "NHD", "LBNHC"),
])
def test_each_rule(model: P.ModelSpec, head_layout: str, expected: str) -> None:
    assert auto_kv_layout(model, head_layout) == expected
    resolved = resolve_layout(model, auto(head_layout))
    assert resolved == P.LayoutSpec(num_blocks=16, block_size_tokens=16, kv_layout=expected,
                                    head_layout=head_layout)


def test_every_rule_names_a_layout_its_head_order_allows() -> None:
    for (kind, head_layout), kv_layout in AUTO_LAYOUTS.items():
        assert kv_layout in ALL_KV_LAYOUTS
        if kind == "hybrid":
            assert kv_layout in HYBRID_KV_LAYOUTS
            assert hybrid_head_layout(kv_layout) == head_layout
        elif kv_layout in VLLM_LAYOUTS:
            assert vllm_head_layout(kv_layout) == head_layout
        elif kv_layout == "head_major":
            assert head_layout == "HND"


def test_explicit_layouts_are_left_alone() -> None:
    for kv_layout in ("kv_split", "blocks_first", "cross_layer", "head_major"):
        spec = P.LayoutSpec(num_blocks=8, block_size_tokens=16, kv_layout=kv_layout)
        assert resolve_layout(PLAIN, spec) is spec
    msg = register(PLAIN, P.LayoutSpec(num_blocks=8, block_size_tokens=16, kv_layout="LBHNC"))
    assert resolve_registration(msg) is msg


def test_unknown_head_layout_is_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="unknown head_layout 'HDN'"):
        resolve_layout(PLAIN, auto("HDN"))


@pytest.mark.parametrize("model", [PLAIN, MLA, HYBRID], ids=["plain", "mla", "hybrid"])
def test_resolution_ignores_tp_pp_and_block_size(model: P.ModelSpec) -> None:
    """Two daemons resolve two engines that may pair alike: same layout, same hash."""
    shapes = [(1, 1, 16, 16), (2, 1, 32, 8), (4, 1, 16, 64)]
    if model.hybrid is None:
        shapes.append((1, 2, 16, 16))
    seen = set()
    for tp, pp, bs, blocks in shapes:
        msg = resolve_registration(register(model, auto(num_blocks=blocks,
                                                        block_size_tokens=bs), tp, pp))
        assert msg.layout.kv_layout != "auto"
        seen.add((msg.layout.kv_layout, compat_hash(model, msg.layout)))
    assert len(seen) == 1


def test_auto_is_never_hashed() -> None:
    with pytest.raises(LayoutError, match="resolved by the engine's own daemon"):
        compat_hash(PLAIN, AUTO)


# ------------------------------------------------------------ registration


def test_registration_sizes_the_pool_by_the_resolved_layout() -> None:
    par, cache, first = validate_registration(register(PLAIN, AUTO, tp=2, tp_rank=1))
    assert isinstance(cache, CacheLayout) and cache.kv_layout == "head_major"
    assert cache.shape == (16, 4, 4, 2, 16, 64)  # (blocks, heads, layers, kv, tokens, dim)
    _, mla_cache, _ = validate_registration(register(MLA, AUTO, tp=2))
    assert isinstance(mla_cache, CacheLayout) and mla_cache.kv_layout == "cross_layer"
    shape = HybridShape(2)
    _, pool, _ = validate_registration(register(HYBRID, auto(
        num_blocks=shape.num_blocks, block_size_tokens=shape.kernel_block_tokens), tp=2))
    assert isinstance(pool, HybridPool)
    assert {g.cache.kv_layout for g in pool.layout.groups if hasattr(g, "cache")} == {"LBHNC"}


def test_auto_and_its_resolution_register_as_one_engine() -> None:
    """Ranks of one engine may say "auto" or the name it resolves to: they agree."""
    table = EngineTable(16)
    first = resolve_registration(register(PLAIN, AUTO, tp=2, tp_rank=0))
    par, _, _ = validate_registration(first)
    assert table.check_joinable(first, par) is None

    rank = SimpleNamespace(rank=RankId(0, 0), pool=SimpleNamespace(addr=0, nbytes=1),
                           cache=SimpleNamespace(num_blocks=16), device_id=0)
    engine = table.add(first, par, rank, "DRAM")  # type: ignore[arg-type]
    assert engine.layout.kv_layout == "head_major" and engine.desc().layout.kv_layout != "auto"
    explicit = register(PLAIN, P.LayoutSpec(num_blocks=16, block_size_tokens=16,
                                             kv_layout="head_major"), tp=2, tp_rank=1)
    assert table.check_joinable(resolve_registration(explicit), par) is engine


# ------------------------------------------------------------ "fastest" against the planner


def _per_block(model: ModelGeometry, kv_layout: str, head_layout: str, prefill: Parallelism,
               decode: Parallelism, blocks: int = 6) -> float | None:
    """Descriptors per block read by decode rank 0 (shuffled, never adjacent block ids);
    None when the planner refuses the pair."""
    plan = plan_transfer(model, prefill, decode)
    ids = 2 * np.random.default_rng(0).permutation(blocks)

    def cache(par: Parallelism, pp_rank: int) -> tuple[CacheLayout, int]:
        l0, l1 = stage_layers(model, par, pp_rank)
        c = CacheLayout(num_layers=l1 - l0, num_blocks=2 * blocks, block_size_tokens=16,
                        num_heads=heads_per_rank(model, par), head_dim=64, dtype_nbytes=2,
                        kv_layout=kv_layout, head_layout=head_layout, mla=model.mla)
        c.validate()
        return c, l0

    rank, reads = sorted(plan.reads.items())[0]
    local, first = cache(decode, rank.pp_rank)
    count = 0
    try:
        for read in reads:
            remote, rfirst = cache(prefill, read.remote.pp_rank)
            count += len(build_read_descriptors(read, local, first, remote, rfirst, ids, ids))
    except LayoutError:
        return None
    return count / blocks


def _allowed(head_layout: str, mla: bool) -> list[str]:
    out = []
    for name in ALL_KV_LAYOUTS:
        if name in VLLM_LAYOUTS and vllm_head_layout(name) != head_layout:
            continue
        if name == "head_major" and head_layout != "HND":
            continue
        out.append(name)
    return out


GEOM = ModelGeometry(num_kv_heads=8, num_layers=8)
HOMOG = (Parallelism(2), Parallelism(2))
HETERO = [(Parallelism(1), Parallelism(2)), (Parallelism(4), Parallelism(2))]


def test_hnd_pick_is_fewest_descriptors_homogeneous_and_hetero() -> None:
    pick = auto_kv_layout(PLAIN, "HND")
    for pre, dec in [HOMOG, *HETERO]:
        counts = {n: _per_block(GEOM, n, "HND" if n not in VLLM_LAYOUTS else
                                vllm_head_layout(n), pre, dec) for n in ALL_KV_LAYOUTS}
        best = min(c for c in counts.values() if c is not None)
        assert counts[pick] == best, (pre, dec, counts)
    # one descriptor per block per read: homogeneous, TP1 -> TP2 and TP4 -> TP2 (2 reads)
    assert [_per_block(GEOM, pick, "HND", *p) for p in [HOMOG, *HETERO]] == [1, 1, 2]


def test_nhd_pick_is_fewest_descriptors_nhd_allows() -> None:
    """NHD: whole-head reads (equal TP, PP splits) are what split NHD layouts serve;
    cross_layer is one per block there, the best of every NHD layout."""
    pick = auto_kv_layout(PLAIN, "NHD")
    for pre, dec in [HOMOG, (Parallelism(1, 2), Parallelism(1))]:
        counts = {n: _per_block(GEOM, n, "NHD", pre, dec) for n in _allowed("NHD", False)}
        assert counts[pick] == min(c for c in counts.values() if c is not None)
    assert _per_block(GEOM, pick, "NHD", *HOMOG) == 1
    assert _per_block(GEOM, pick, "NHD", *HETERO[0]) is None  # head slices need HND


def test_mla_pick_is_one_descriptor_per_block_for_any_pairing() -> None:
    geom = ModelGeometry(num_kv_heads=1, num_layers=6, mla=True)
    pick = auto_kv_layout(MLA, "HND")
    for pre, dec in [(Parallelism(2), Parallelism(2)), (Parallelism(2), Parallelism(3)),
                     (Parallelism(4), Parallelism(1)), (Parallelism(2), Parallelism(1, 3))]:
        reads = len(sorted(plan_transfer(geom, pre, dec).reads.items())[0][1])
        for head_layout in ("HND", "NHD"):
            assert _per_block(geom, pick, head_layout, pre, dec) == reads


def test_hybrid_pick_keeps_a_head_range_of_a_page_one_run() -> None:
    """Of the hybrid orders (whole pages per layer), LBHNC has the fewest descriptors per
    (layer, block) page: one, for whole heads and for a TP1 -> TP2 head slice alike."""
    pick = auto_kv_layout(HYBRID, "HND")
    hnd = [n for n in HYBRID_KV_LAYOUTS if hybrid_head_layout(n) == "HND"]
    for pre, dec in [HOMOG, *HETERO]:
        counts = {n: _per_block(GEOM, n, "HND", pre, dec) for n in hnd}
        assert counts[pick] == min(counts.values()), counts
    assert _per_block(GEOM, pick, "HND", *HETERO[0]) == GEOM.num_layers  # one per layer
    assert _per_block(GEOM, "blocks_first", "HND", *HETERO[0]) == 2 * GEOM.num_layers

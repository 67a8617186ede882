"""Hypothesis cases and pool builders shared by the planner's property tests.

``pairs``/``byte_cases`` draw a model and two parallelisms (and, for the byte-level
check, block sizes, layouts and a seed); ``pulls`` draws a whole pull between two
engine shapes, and ``rank_pools`` lays every rank's pool of a shape end to end in one
buffer. Used by tests/planner/test_planner_properties.py, test_planner_vllm_layouts.py,
test_assembly.py and test_prepared_pull.py.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvd.planner import ModelGeometry, Parallelism, RankId
from kvd.planner.assembly import RankPool
from kvd.planner.layout import ALL_KV_LAYOUTS, HEAD_LAYOUTS
from kvd.pool.geometry import parallelism as rank_parallelism
from kvd.pool.geometry import rank_layout
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

HEAD_DIM = 2
KV_LAYOUTS = ("kv_split", "blocks_first", "cross_layer", "head_major")


def valid_tps(model: ModelGeometry) -> list[int]:
    k = model.num_kv_heads
    return [t for t in range(1, 17) if model.mla or k % t == 0 or t % k == 0]


@st.composite
def parallelism(draw, model: ModelGeometry) -> Parallelism:
    tp = draw(st.sampled_from(valid_tps(model)))
    pp = draw(st.integers(1, min(4, model.num_layers)))
    part = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, model.num_layers - 1),
                                   min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, model.num_layers]
        part = tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return Parallelism(tp, pp, part)


@st.composite
def pairs(draw, max_layers: int = 12):
    mla = draw(st.booleans())
    model = ModelGeometry(draw(st.integers(1, 64)), draw(st.integers(1, max_layers)), mla)
    return model, draw(parallelism(model)), draw(parallelism(model))


def ranks(par: Parallelism) -> list[RankId]:
    return [RankId(tp, pp) for pp in range(par.pp_size) for tp in range(par.tp_size)]


@st.composite
def byte_cases(draw):
    model, prefill, decode = draw(pairs(max_layers=5))
    bs_p = draw(st.sampled_from([1, 2, 4]))
    bs_d = draw(st.sampled_from([bs_p, bs_p, bs_p * 2, bs_p * 4, max(1, bs_p // 2),
                                 max(1, bs_p // 4)]))
    num_tokens = draw(st.integers(1, 13))
    kv_layouts = draw(st.tuples(st.sampled_from(KV_LAYOUTS), st.sampled_from(KV_LAYOUTS)))
    nhd = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return model, prefill, decode, bs_p, bs_d, num_tokens, kv_layouts, nhd, seed


def rank_pools(model: ModelSpec, shape: EngineShape, owners: int = 1
           ) -> tuple[np.ndarray, list[tuple[RankId, RankPool, np.ndarray]]]:
    """One flat buffer holding every rank's pool end to end; base address = offset."""
    par = rank_parallelism(shape.tp_size, shape.pp_size, None)
    spec = layout_spec(shape)
    ranks, base = [], 0
    for p in range(shape.pp_size):
        for t in range(shape.tp_size):
            cache, first = rank_layout(model, spec, par, p)
            rid = RankId(t, p)
            ranks.append((rid, RankPool(rid, cache, first, base, owner=f"agent{t % owners}"),
                          cache))
            base += cache.total_nbytes
    flat = np.zeros(base, dtype=np.uint8)
    out = []
    for rid, pool, cache in ranks:
        view = flat[pool.base_addr:pool.base_addr + cache.total_nbytes]
        out.append((rid, pool, view.view(np.uint16).reshape(cache.shape)))
    return flat, out


@st.composite
def pulls(draw):
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 3))
    tps = [t for t in (1, 2, 4) if mla or heads % t == 0 or t % heads == 0]
    ptp, dtp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    ppp, dpp = draw(st.integers(1, min(2, layers))), draw(st.integers(1, min(2, layers)))
    bsd = draw(st.sampled_from([2, 4, 8]))
    bsp = draw(st.sampled_from([bsd // 2, bsd, bsd * 2] if bsd > 2 else [bsd, bsd * 2]))
    kv_layout = draw(st.sampled_from(ALL_KV_LAYOUTS))
    head_layout = "HND" if kv_layout == "head_major" else draw(st.sampled_from(HEAD_LAYOUTS))
    tokens = draw(st.integers(1, 24))
    total_local = -(-tokens // bsd)
    # A prefix hit the engine could have: whole decode blocks ending on a prefill block.
    hits = [k for k in range(total_local) if (k * bsd) % bsp == 0]
    skip = draw(st.sampled_from(hits))
    n_remote, n_local = -(-tokens // bsp), total_local - skip
    p_blocks, d_blocks = n_remote + draw(st.integers(0, 3)), n_local + draw(st.integers(0, 3))
    p_ids = draw(st.permutations(range(p_blocks)))[:n_remote]
    d_ids = draw(st.permutations(range(d_blocks)))[:n_local]
    model = ModelSpec(name="prop", num_kv_heads=heads, num_layers=layers, head_dim=4,
                      dtype="bfloat16", mla=mla)
    pshape = EngineShape(ptp, ppp, bsp, p_blocks, kv_layout, head_layout)
    dshape = EngineShape(dtp, dpp, bsd, d_blocks, kv_layout, head_layout)
    return model, pshape, dshape, tokens, skip * bsd, list(p_ids), list(d_ids)

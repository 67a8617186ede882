"""vLLM's layouts by name: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC.

The oracle builds every pool from a logical [layer, block, head, token, kv, dim]
array transposed into the name's order (C = K then V of one head and token), and
shares nothing with kvd.planner.layout but CacheLayout.shape, which it checks
against its own. The strides are checked against vLLM's own stride rule.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planner_cases import HEAD_DIM, byte_cases, ranks
from support.planner_sim import apply_descriptors, global_kv
from support.planner_sim import fill_pool as fill_split_pool

from kvd.daemon.engines.table import compat_hash
from kvd.errors import LayoutError
from kvd.planner import (
    CacheLayout,
    ModelGeometry,
    Parallelism,
    RankId,
    Read,
    build_read_descriptors,
    heads_per_rank,
    plan_transfer,
    rank_heads,
    stage_layers,
)
from kvd.planner.assembly import match_tail
from kvd.planner.layout import VLLM_LAYOUTS
from kvd.pool.geometry import rank_layout
from kvd.tools import sim
from kvd.wire.protocol import ModelSpec

# vllm/v1/kv_cache_layout.py (vLLM 0.32): KVCacheLayout values, the physical order of the
# logical axes [L, B, H, N, C] outermost first.
VLLM_STRIDE_ORDER = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
DTYPE = np.int32


def token_major(name: str) -> bool:
    return name in VLLM_LAYOUTS and name.index("N") < name.index("H")


def vllm_layout(name: str, *, layers: int = 4, blocks: int = 64, bs: int = 16, heads: int = 8,
                head_dim: int = 128, dtype_nbytes: int = 2, mla: bool = False) -> CacheLayout:
    return CacheLayout(num_layers=layers, num_blocks=blocks, block_size_tokens=bs,
                       num_heads=heads, head_dim=head_dim, dtype_nbytes=dtype_nbytes,
                       kv_layout=name, head_layout="NHD" if token_major(name) else "HND",
                       mla=mla)


def oracle_pool(name: str, num_layers: int, num_blocks: int, num_heads: int, bs: int,
                kv_parts: int, kv: np.ndarray, layers: tuple[int, int], heads: tuple[int, int],
                block_ids, first_token: int = 0, fill: int = -1) -> np.ndarray:
    """A rank's pool holding tokens [first_token, ...) of its shard in block_ids, fill elsewhere."""
    head_dim = kv.shape[-1]
    logical = np.full((num_layers, num_blocks, num_heads, bs, kv_parts, head_dim), fill,
                      kv.dtype)
    for i, block in enumerate(block_ids):
        t0, t1 = first_token + i * bs, min(kv.shape[2], first_token + (i + 1) * bs)
        if t0 >= t1:
            break
        data = kv[layers[0]:layers[1], :, t0:t1, heads[0]:heads[1], :]  # [l, kv, t, h, d]
        logical[:, block, :, : t1 - t0] = data.transpose(0, 3, 2, 1, 4)  # [l, h, t, kv, d]
    phys = logical.transpose([*("LBHN".index(a) for a in name[:4]), 4, 5])
    return np.ascontiguousarray(phys).reshape(*phys.shape[:4], kv_parts * head_dim)


# ---------------------------------------------------------------- the layouts themselves


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
def test_names_and_strides_are_vllms(name):
    """The name is the physical order of vLLM's logical axes; byte strides follow vLLM's
    compute_layout_strides (dense, innermost last) with C = (head_size + head_size_v) bytes."""
    assert "".join("LBHNC"[d] for d in VLLM_STRIDE_ORDER[name]) == name
    lay = vllm_layout(name, layers=3, blocks=5, bs=4, heads=6, head_dim=8)
    logical = (3, 5, 6, 4, 2 * 8 * 2)  # [L, B, H, N, C bytes]
    strides, cur = [0] * 5, 1
    for dim in reversed(VLLM_STRIDE_ORDER[name]):
        strides[dim] = cur
        cur *= logical[dim]
    s = lay.strides_nbytes()
    assert (s["layer"], s["block"], s["head"], s["token"]) == tuple(strides[:4])
    assert s["kv"] == 8 * 2  # V follows K inside the channel
    assert cur == lay.total_nbytes
    assert lay.shape == tuple(logical[d] for d in VLLM_STRIDE_ORDER[name][:4]) + (16,)
    view = np.zeros(lay.shape, dtype=np.int16)  # the numpy view of the pool has them too
    assert view.strides[:4] == tuple(strides[d] for d in VLLM_STRIDE_ORDER[name][:4])
    mla = vllm_layout(name, heads=1, head_dim=8, mla=True)
    assert mla.shape[-1] == 8 and mla.total_nbytes == int(np.prod(mla.shape)) * 2


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
def test_head_layout_must_agree_with_the_name_in_one_line(name):
    vllm_layout(name).validate()
    wrong = "HND" if token_major(name) else "NHD"
    lay = CacheLayout(4, 64, 16, 8, 128, 2, kv_layout=name, head_layout=wrong)
    with pytest.raises(LayoutError, match=f"kv_layout {name} is") as info:
        lay.validate()
    assert "\n" not in str(info.value)
    with pytest.raises(LayoutError, match="unknown kv_layout"):
        CacheLayout(4, 64, 16, 8, 128, 2, kv_layout=name.lower()).validate()


def test_split_layouts_and_transposes_are_refused():
    read = Read(RankId(0), (0, 8), (0, 8), (0, 8), (0, 4))
    split = CacheLayout(4, 64, 16, 8, 128, 2, kv_layout="blocks_first")
    ids = np.arange(2)
    with pytest.raises(LayoutError, match="side by side in LBHNC but apart in blocks_first"):
        build_read_descriptors(read, vllm_layout("LBHNC"), 0, split, 0, ids, ids)
    with pytest.raises(LayoutError, match="side by side in BLNHC but apart in blocks_first"):
        build_read_descriptors(read, split, 0, vllm_layout("BLNHC"), 0, ids, ids)
    with pytest.raises(LayoutError, match="head layouts differ"):
        build_read_descriptors(read, vllm_layout("LBHNC"), 0, vllm_layout("BLNHC"), 0, ids, ids)


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
@pytest.mark.parametrize("mla", [False, True])
def test_daemon_registration_and_sim_engines_speak_the_names(name, mla):
    """rank_layout (what the daemon validates at registration) takes the names as they are;
    kvd.tools.sim's engines write and check exactly the oracle's bytes."""
    model = ModelSpec(name="m", num_kv_heads=1 if mla else 4, num_layers=3, head_dim=8,
                      mla=mla)
    shape = sim.EngineShape(tp_size=2, block_size_tokens=4, num_blocks=6, kv_layout=name)
    spec = sim.layout_spec(shape)
    assert spec.head_layout == ("NHD" if token_major(name) else "HND")
    cache, first = rank_layout(model, spec, Parallelism(2), 0)
    assert (cache.kv_layout, first) == (name, 0)
    other = sim.layout_spec(sim.EngineShape(tp_size=2, kv_layout="LBHNC"))
    assert (compat_hash(model, spec) == compat_hash(model, other)) == (name == "LBHNC")
    g = sim.global_kv(model, 10, seed=4)
    ids = [5, 1, 3]
    kv_parts = 1 if mla else 2
    for tp in range(2):
        heads = (0, 1) if mla else (2 * tp, 2 * tp + 2)
        pool = np.zeros(cache.shape, dtype=np.uint16)
        sim.write_shard(pool, g, model, shape, tp, 0, ids)
        want = oracle_pool(name, 3, 6, cache.num_heads, 4, kv_parts, g, (0, 3), heads, ids,
                           fill=0)
        np.testing.assert_array_equal(pool, want)
        assert sim.check_shard(pool, g, model, shape, tp, 0, ids) == 0
        pool.reshape(-1)[np.flatnonzero(want.reshape(-1))[7]] ^= 1
        assert sim.check_shard(pool, g, model, shape, tp, 0, ids) == 1


# ---------------------------------------------------------------- bytes over the grid


def _layout(model: ModelGeometry, par: Parallelism, pp_rank: int, bs: int, num_blocks: int,
            name: str) -> CacheLayout:
    l0, l1 = stage_layers(model, par, pp_rank)
    return CacheLayout(num_layers=l1 - l0, num_blocks=num_blocks, block_size_tokens=bs,
                       num_heads=heads_per_rank(model, par), head_dim=HEAD_DIM, dtype_nbytes=4,
                       kv_layout=name, head_layout="NHD" if token_major(name) else "HND",
                       mla=model.mla)


def fewest(local_expected: np.ndarray, remote_pool: np.ndarray, kv_shape: tuple[int, ...],
           heads: tuple[int, int], layers: tuple[int, int]) -> int:
    """Fewest byte ranges that can move one read: maximal runs, in local order, that are
    contiguous on both sides (element values are unique, so each says where it came from)."""
    flat_l, flat_r = local_expected.reshape(-1), remote_pool.reshape(-1)
    local_pos = np.flatnonzero(flat_l >= 0)
    values = flat_l[local_pos]
    layer, _, _, head, _ = np.unravel_index(values, kv_shape)
    mine = (layer >= layers[0]) & (layer < layers[1]) & (head >= heads[0]) & (head < heads[1])
    local_pos, values = local_pos[mine], values[mine]
    where = np.full(int(np.prod(kv_shape)), -1, dtype=np.int64)
    held = np.flatnonzero(flat_r >= 0)
    where[flat_r[held]] = held
    remote_pos = where[values]
    assert (remote_pos >= 0).all()
    breaks = (np.diff(local_pos) != 1) | (np.diff(remote_pos) != 1)
    return int(breaks.sum()) + 1 if local_pos.size else 0


def run_vllm_bytes(model: ModelGeometry, prefill: Parallelism, decode: Parallelism, bs_p: int,
                   bs_d: int, num_tokens: int, names: tuple[str, str], seed: int,
                   skip_tokens: int = 0, sorted_ids: tuple[bool, bool] = (True, False)
                   ) -> dict[RankId, int]:
    """Shard, plan, copy, compare every decode element; returns descriptors per decode rank.

    Every read must be byte-exact, or refused when both ranks hold several heads in
    different head/token orders. With the decode block table in ascending order, also as
    few descriptors as the bytes allow; in any other order the merge follows the request,
    and two blocks that happen to sit next to each other on both sides without being
    neighbours in the request stay apart (that is the only slack).
    """
    rng = np.random.default_rng(seed)
    kv_parts = 1 if model.mla else 2
    num_heads = 1 if model.mla else model.num_kv_heads
    n_p, n_d = math.ceil(num_tokens / bs_p), math.ceil(num_tokens / bs_d)
    # A partial last block travels whole up to the smaller block size's boundary (its tail
    # is the engine's garbage), so the oracle gives those tokens values too.
    padded = math.ceil(num_tokens / min(bs_p, bs_d)) * min(bs_p, bs_d)
    kv = global_kv(model.num_layers, kv_parts, padded, num_heads, HEAD_DIM)
    pool_p, pool_d = n_p + 3, n_d + 2
    ids_p = rng.permutation(pool_p)[:n_p]
    ids_d = rng.permutation(pool_d)[:n_d]
    if sorted_ids[0]:
        ids_p.sort()
    if sorted_ids[1]:
        ids_d.sort()
    local_ids, remote_ids = match_tail(ids_d[skip_tokens // bs_d:], ids_p, bs_d, bs_p,
                                       num_tokens)
    p_pools = {}
    for p_rank in ranks(prefill):
        lay = _layout(model, prefill, p_rank.pp_rank, bs_p, pool_p, names[0])
        pool = oracle_pool(names[0], lay.num_layers, pool_p, lay.num_heads, bs_p, kv_parts, kv,
                           stage_layers(model, prefill, p_rank.pp_rank),
                           rank_heads(model, prefill, p_rank.tp_rank), ids_p)
        assert pool.shape == lay.shape
        p_pools[p_rank] = (lay, pool)
    counts: dict[RankId, int] = {}
    for d_rank, reads in plan_transfer(model, prefill, decode).reads.items():
        lay = _layout(model, decode, d_rank.pp_rank, bs_d, pool_d, names[1])
        d_layers = stage_layers(model, decode, d_rank.pp_rank)
        d_heads = rank_heads(model, decode, d_rank.tp_rank)
        expected = oracle_pool(names[1], lay.num_layers, pool_d, lay.num_heads, bs_d, kv_parts,
                               kv, d_layers, d_heads, local_ids, first_token=skip_tokens)
        assert expected.shape == lay.shape
        actual = np.full(lay.shape, -1, dtype=DTYPE)
        written = np.zeros(lay.total_nbytes, dtype=np.int32)
        counts[d_rank] = 0
        for read in reads:
            p_lay, p_pool = p_pools[read.remote]
            p_first = stage_layers(model, prefill, read.remote.pp_rank)[0]
            if (lay.num_heads > 1 and p_lay.num_heads > 1
                    and token_major(names[0]) != token_major(names[1])):
                with pytest.raises(LayoutError, match="head layouts differ"):
                    build_read_descriptors(read, lay, d_layers[0], p_lay, p_first, local_ids,
                                           remote_ids)
                return {}
            desc = build_read_descriptors(read, lay, d_layers[0], p_lay, p_first, local_ids,
                                          remote_ids)
            apply_descriptors(desc, actual, p_pool, written)
            least = fewest(expected, p_pool, kv.shape, read.heads, read.layers)
            assert len(desc) == least if sorted_ids[1] else len(desc) >= least
            counts[d_rank] += len(desc)
        assert written.max(initial=0) <= 1, "a local byte was written twice"
        np.testing.assert_array_equal(actual, expected)
    return counts


@st.composite
def vllm_cases(draw, same_name: bool):
    """The grid of the split layouts' byte test (K 1..64, TP 1..16, PP 1..4, MLA, block sizes
    1..4 in every ratio), vLLM names on both sides, and a prefix hit of whole big blocks."""
    model, prefill, decode, bs_p, bs_d, num_tokens, _, _, seed = draw(byte_cases())
    name = draw(st.sampled_from(VLLM_LAYOUTS))
    names = (name, name) if same_name else (name, draw(st.sampled_from(VLLM_LAYOUTS)))
    big = max(bs_p, bs_d)
    skip = big * draw(st.integers(0, (num_tokens - 1) // big))
    if bs_p > bs_d and math.ceil((num_tokens - skip) / bs_d) % (bs_p // bs_d):
        skip = 0  # match_tail cannot tell such a tail from a prefix of partial blocks
    sorted_ids = (draw(st.booleans()), draw(st.booleans()))
    return model, prefill, decode, bs_p, bs_d, num_tokens, names, seed, skip, sorted_ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vllm_cases(same_name=True))
def test_bytes_land_where_the_decode_shard_expects(case):
    """One layout on both engines (what the daemon pairs): every head slice, replication,
    PP split, block-size ratio and prefix hit lands byte-exact in the fewest descriptors."""
    run_vllm_bytes(*case[:-2], skip_tokens=case[-2], sorted_ids=case[-1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vllm_cases(same_name=False))
def test_any_two_vllm_layouts_pair_or_refuse_a_transpose(case):
    run_vllm_bytes(*case[:-2], skip_tokens=case[-2], sorted_ids=case[-1])


NAMED = {  # (K, layers, prefill TP x PP, decode TP x PP, bs_p, bs_d, tokens, mla)
    "tp1-tp2": (8, 4, (1, 1), (2, 1), 4, 4, 13, False),
    "tp4-tp2": (8, 4, (4, 1), (2, 1), 4, 4, 13, False),
    "non-multiple-k24-6-4": (24, 3, (6, 1), (4, 1), 4, 4, 9, False),
    "non-multiple-k12-4-6": (12, 3, (4, 1), (6, 1), 4, 4, 9, False),
    "replicated-k2-tp1-tp8": (2, 3, (1, 1), (8, 1), 2, 2, 7, False),
    "replicated-k2-tp8-tp2": (2, 3, (8, 1), (2, 1), 2, 2, 7, False),
    "ratio-decode-bigger": (8, 3, (1, 1), (2, 1), 2, 8, 13, False),
    "ratio-prefill-bigger": (8, 3, (4, 1), (2, 1), 8, 2, 13, False),
    "pp2-tp1-to-pp3-tp2": (8, 7, (1, 2), (2, 3), 4, 4, 9, False),
    "mla-2-3-pp": (1, 5, (2, 2), (3, 1), 4, 2, 11, True),
}


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
@pytest.mark.parametrize("case", list(NAMED))
def test_named_shapes_are_byte_exact(case, name):
    k, layers, (tp_p, pp_p), (tp_d, pp_d), bs_p, bs_d, tokens, mla = NAMED[case]
    model = ModelGeometry(k, layers, mla)
    counts = run_vllm_bytes(model, Parallelism(tp_p, pp_p), Parallelism(tp_d, pp_d), bs_p, bs_d,
                            tokens, (name, name), seed=5)
    assert set(counts) == set(ranks(Parallelism(tp_d, pp_d)))
    big = max(bs_p, bs_d)  # a prefix hit of one big block, whole blocks after it
    run_vllm_bytes(model, Parallelism(tp_p, pp_p), Parallelism(tp_d, pp_d), bs_p, bs_d,
                   math.ceil(tokens / big) * big, (name, name), seed=6, skip_tokens=big,
                   sorted_ids=(False, True))


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
@pytest.mark.parametrize("split", ["kv_split", "blocks_first", "cross_layer", "head_major"])
def test_mla_pairs_with_split_layouts(name, split):
    """One latent per token: no K/V to interleave, so a vLLM MLA pool pairs with any."""
    model, bs, tokens = ModelGeometry(1, 3, mla=True), 4, 10
    kv = global_kv(3, 1, tokens, 1, HEAD_DIM)
    ids_p, ids_d = np.array([4, 0, 2]), np.array([1, 3, 0])
    for local_name, remote_name in ((name, split), (split, name)):
        lays = [_layout(model, Parallelism(1), 0, bs, 5, n) for n in (local_name, remote_name)]
        pools = []
        for lay, ids in zip(lays, (ids_d, ids_p), strict=True):
            if lay.vllm:
                pools.append(oracle_pool(lay.kv_layout, 3, 5, 1, bs, 1, kv, (0, 3), (0, 1), ids))
            else:
                pools.append(fill_split_pool(lay, kv, (0, 3), (0, 1), ids))
        read = plan_transfer(model, Parallelism(1), Parallelism(1)).reads[RankId(0)][0]
        desc = build_read_descriptors(read, lays[0], 0, lays[1], 0, ids_d, ids_p)
        actual = np.full(lays[0].shape, -1, dtype=DTYPE)
        apply_descriptors(desc, actual, pools[1], np.zeros(lays[0].total_nbytes, np.int32))
        np.testing.assert_array_equal(actual, pools[0])


# ---------------------------------------------------------------- descriptor counts


def llama_counts(name: str, tp_p: int, tp_d: int, n: int) -> tuple[dict[RankId, int], set[int]]:
    """Descriptors per decode rank and their sizes: 32 layers, 8 KV heads, head_dim 128,
    bf16, 16-token blocks, n shuffled blocks that are never adjacent."""
    model = ModelGeometry(8, 32)
    rng = np.random.default_rng(0)
    local_ids, remote_ids = 2 * rng.permutation(n), 2 * rng.permutation(n)
    plan = plan_transfer(model, Parallelism(tp_p), Parallelism(tp_d))
    counts, sizes = {}, set()
    for d_rank, reads in plan.reads.items():
        lay = vllm_layout(name, layers=32, blocks=2 * n, heads=8 // tp_d)
        rlay = vllm_layout(name, layers=32, blocks=2 * n, heads=8 // tp_p)
        counts[d_rank] = 0
        for read in reads:
            desc = build_read_descriptors(read, lay, 0, rlay, 0, local_ids, remote_ids)
            counts[d_rank] += len(desc)
            sizes |= set(desc.nbytes.tolist())
    return counts, sizes


# What each layout's order makes contiguous on both sides, per decode rank of n blocks
# (L = 32 layers, N = 16 tokens, C = K||V of one head and token = 512 B, h = heads read):
# HN pages ([H][N][C]) hold a head range of a (layer, block) in one run; head-outer orders
# split it per head; NH pages ([N][H][C]) cut to a head range give one run per token.
L, N, C = 32, 16, 512
EXPECTED = {  # name: {(tp_p, tp_d): (descriptors per decode rank, descriptor bytes)}
    "LBHNC": {(1, 2): (L, 4 * N * C), (4, 2): (2 * L, 2 * N * C), (2, 2): (L, 4 * N * C)},
    "BLHNC": {(1, 2): (L, 4 * N * C), (4, 2): (2 * L, 2 * N * C), (2, 2): (1, L * 4 * N * C)},
    "LHBNC": {(1, 2): (L * 4, N * C), (4, 2): (L * 4, N * C), (2, 2): (L * 4, N * C)},
    "BHLNC": {(1, 2): (1, 4 * L * N * C), (4, 2): (2, 2 * L * N * C),
              (2, 2): (1, 4 * L * N * C)},
    "LBNHC": {(1, 2): (L * N, 4 * C), (4, 2): (2 * L * N, 2 * C), (2, 2): (L, N * 4 * C)},
    "BLNHC": {(1, 2): (L * N, 4 * C), (4, 2): (2 * L * N, 2 * C), (2, 2): (1, L * N * 4 * C)},
}


@pytest.mark.parametrize("name", VLLM_LAYOUTS)
@pytest.mark.parametrize("tps", [(1, 2), (4, 2), (2, 2)])
def test_llama_descriptors_per_block(name, tps):
    n = 24
    per_block, nbytes = EXPECTED[name][tps]
    counts, sizes = llama_counts(name, *tps, n)
    assert counts == {RankId(t): n * per_block for t in range(tps[1])}
    assert sizes == {nbytes}


# ---------------------------------------------------------------- kvd plan --layout


def plan_cli(*opts: str):
    from typer.testing import CliRunner

    from kvd.cli import app

    return CliRunner().invoke(app, ["plan", "--kv-heads", "8", "--layers", "32", *opts])


@pytest.mark.parametrize("tps", [(1, 2), (4, 2)])
def test_kvd_plan_counts_descriptors_per_decode_rank(tps):
    """`kvd plan --layout` prints what the descriptor builder makes, per decode rank."""
    n = 24
    opts = ["--prefill-tp", str(tps[0]), "--decode-tp", str(tps[1]), "--tokens", str(16 * n),
            "--block-size", "16", "--head-dim", "128"]
    result = plan_cli(*opts, "--layout", ",".join(VLLM_LAYOUTS), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [d["layout"] for d in out["descriptors"]] == list(VLLM_LAYOUTS)
    for entry in out["descriptors"]:
        per_block, nbytes = EXPECTED[entry["layout"]][tps]
        assert entry["decode_ranks"] == {
            f"{t}/0": {"descriptors": n * per_block, "nbytes": n * 16 * 4 * 32 * 2 * 128 * 2}
            for t in range(tps[1])}
        assert entry["total"] == tps[1] * n * per_block
    table = plan_cli(*opts, "--layout", "BHLNC")
    assert table.exit_code == 0, table.output
    want = n * EXPECTED["BHLNC"][tps][0]
    rows = [line.split() for line in table.stdout.splitlines()]
    assert ["0/0", str(len(out["decode_ranks"][0]["reads"])), str(want)] == rows[-3][:3]
    assert rows[-1][:3] == ["total", str(sum(len(d["reads"]) for d in out["decode_ranks"])),
                            str(tps[1] * want)]
    every = plan_cli(*opts, "--layout", "all")
    assert every.exit_code == 0, every.output
    assert {line.split()[0] for line in every.stdout.splitlines()[-10:]} == {
        "kv_split", "blocks_first", "cross_layer", "head_major", *VLLM_LAYOUTS}


@pytest.mark.parametrize(("opts", "needle"), [
    (("--layout", "LBHCN"), "unknown layout 'LBHCN'"),
    (("--layout", "LBHNC", "--block-size", "0"), "--block-size must be >= 1"),
    (("--layout", "LBHNC", "--block-size", "12", "--decode-block-size", "16"), "do not divide"),
])
def test_kvd_plan_bad_layout_options_exit_2_in_one_line(opts, needle):
    result = plan_cli("--prefill-tp", "1", "--decode-tp", "2", *opts)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr

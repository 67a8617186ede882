"""Descriptor building: merging, block-size ratios, and the layouts we refuse."""

from __future__ import annotations

import numpy as np
import pytest

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
    stage_layers,
)


def layout(**kw) -> CacheLayout:
    base = dict(num_layers=4, num_blocks=64, block_size_tokens=16, num_heads=8, head_dim=128,
                dtype_nbytes=2)
    return CacheLayout(**{**base, **kw})


def whole(heads=8, layers=(0, 4)) -> Read:
    return Read(RankId(0), (0, heads), (0, heads), (0, heads), layers)


def test_shapes_follow_the_documented_axis_order():
    assert layout().shape == (4, 2, 64, 8, 16, 128)
    assert layout(kv_layout="blocks_first").shape == (4, 64, 2, 8, 16, 128)
    assert layout(head_layout="NHD").shape == (4, 2, 64, 16, 8, 128)
    assert layout(mla=True, num_heads=1).shape == (4, 1, 64, 1, 16, 128)
    lay = layout()
    assert lay.block_nbytes == 8 * 16 * 128 * 2
    assert lay.total_nbytes == int(np.prod(lay.shape)) * 2


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"head_dim": -1}, "head_dim"),
        ({"kv_layout": "paged"}, "unknown kv_layout"),
        ({"head_layout": "HDN"}, "unknown head_layout"),
        ({"mla": True}, "MLA"),
    ],
)
def test_validate_names_the_reason(kw, needle):
    with pytest.raises(LayoutError, match=needle):
        layout(**kw).validate()


@pytest.mark.parametrize(("kv_layout", "expected"), [("kv_split", 8), ("blocks_first", 4)])
def test_consecutive_whole_block_reads_collapse(kv_layout, expected):
    local, remote = layout(kv_layout=kv_layout), layout(kv_layout=kv_layout)
    ids = np.arange(10, 40)
    desc = build_read_descriptors(whole(), local, 0, remote, 0, ids, ids + 5)
    # one descriptor per (layer, kv) region, or per layer when K and V sit in one block
    assert len(desc) == expected
    assert desc.total_nbytes == 4 * 2 * 30 * local.block_nbytes
    assert desc.nbytes.dtype == desc.local_offsets.dtype == desc.remote_offsets.dtype == np.int64


def test_identical_full_pools_become_one_descriptor():
    lay = layout()
    ids = np.arange(64)
    desc = build_read_descriptors(whole(), lay, 0, lay, 0, ids, ids)
    assert len(desc) == 1 and desc.nbytes[0] == lay.total_nbytes


def test_head_slices_are_one_descriptor_per_block():
    local, remote = layout(num_heads=4), layout(num_heads=8)
    read = Read(RankId(1), (4, 8), (0, 4), (4, 8), (0, 4))
    desc = build_read_descriptors(read, local, 0, remote, 0, np.arange(3), np.arange(3))
    assert len(desc) == 4 * 2 * 3
    assert set(desc.nbytes.tolist()) == {4 * 16 * 128 * 2}
    assert desc.remote_offsets[0] == 4 * 16 * 128 * 2  # starts at head 4 of remote block 0


def test_small_prefill_blocks_fill_big_decode_blocks_and_merge():
    # One head each side (GQA replication): remote blocks 0..7 of 4 tokens are the
    # four quarters of local blocks 0..1 of 16 tokens, contiguous on both sides.
    local = layout(num_heads=1, block_size_tokens=16)
    remote = layout(num_heads=1, block_size_tokens=4)
    read = Read(RankId(0), (3, 4), (0, 1), (0, 1), (0, 4))
    desc = build_read_descriptors(read, local, 0, remote, 0, np.arange(2), np.arange(7))
    assert len(desc) == 4 * 2  # per (layer, kv); the 7th remote block fills 3/4 of local 1
    assert desc.total_nbytes == 4 * 2 * 7 * remote.block_nbytes


def test_block_count_must_match_the_ratio():
    local, remote = layout(block_size_tokens=16), layout(block_size_tokens=4)
    with pytest.raises(LayoutError, match="do not fill"):
        build_read_descriptors(whole(), local, 0, remote, 0, np.arange(2), np.arange(9))
    with pytest.raises(LayoutError, match="do not match"):
        build_read_descriptors(whole(), remote, 0, local, 0, np.arange(9), np.arange(2))


@pytest.mark.parametrize(
    ("local_kw", "remote_kw", "needle"),
    [
        ({"block_size_tokens": 16}, {"block_size_tokens": 12}, "do not divide"),
        ({"head_dim": 64}, {}, "head_dim differs"),
        ({"dtype_nbytes": 1}, {}, "dtype size differs"),
        ({"head_layout": "NHD"}, {}, "head layouts differ"),
        ({"mla": True, "num_heads": 1}, {}, "MLA"),
    ],
)
def test_incompatible_pairs_are_refused(local_kw, remote_kw, needle):
    read = Read(RankId(0), (0, 1), (0, 1), (0, 1), (0, 4))
    with pytest.raises(LayoutError, match=needle):
        build_read_descriptors(read, layout(**local_kw), 0, layout(**remote_kw), 0,
                               np.arange(2), np.arange(2))


def test_nhd_head_slices_are_refused_but_whole_heads_work():
    local, remote = layout(num_heads=4, head_layout="NHD"), layout(head_layout="NHD")
    read = Read(RankId(0), (0, 4), (0, 4), (0, 4), (0, 4))
    with pytest.raises(LayoutError, match="NHD caches cannot be head-sliced"):
        build_read_descriptors(read, local, 0, remote, 0, np.arange(2), np.arange(2))
    nhd = layout(head_layout="NHD")
    desc = build_read_descriptors(whole(), nhd, 0, nhd, 0, np.arange(2), np.arange(2))
    assert len(desc) == 8


def test_reads_outside_the_ranks_are_refused():
    lay = layout()
    with pytest.raises(LayoutError, match="local cache"):
        build_read_descriptors(whole(layers=(0, 4)), lay, 1, lay, 0, np.arange(2), np.arange(2))
    with pytest.raises(LayoutError, match="block id out of range"):
        build_read_descriptors(whole(), lay, 0, lay, 0, np.array([64]), np.array([0]))
    empty = build_read_descriptors(whole(), lay, 0, lay, 0, np.arange(0), np.arange(0))
    assert len(empty) == 0 and empty.total_nbytes == 0


def test_global_layers_map_to_stage_local_indices():
    lay = layout()
    read = whole(layers=(10, 11))
    desc = build_read_descriptors(read, lay, 8, lay, 10, np.array([0]), np.array([0]))
    assert desc.local_offsets[0] == 2 * 2 * 64 * lay.block_nbytes  # third local layer
    assert desc.remote_offsets[0] == 0


# ---------------------------------------------------------------- cross_layer


def test_cross_layer_shape_and_strides():
    lay = layout(kv_layout="cross_layer")
    assert lay.shape == (64, 4, 2, 8, 16, 128)
    assert layout(kv_layout="cross_layer", head_layout="NHD").shape == (64, 4, 2, 16, 8, 128)
    assert layout(kv_layout="cross_layer", mla=True, num_heads=1).shape == (64, 4, 1, 1, 16, 128)
    body = 8 * 16 * 128 * 2
    assert lay.strides_nbytes() == {"layer": 2 * body, "kv": body, "block": 4 * 2 * body,
                                    "head": 16 * 128 * 2, "token": 128 * 2}
    assert lay.total_nbytes == layout().total_nbytes == int(np.prod(lay.shape)) * 2
    # the strides are those of the numpy view of the pool
    view = np.zeros(lay.shape, dtype=np.int16)
    s = lay.strides_nbytes()
    assert view.strides[:5] == (s["block"], s["layer"], s["kv"], s["head"], s["token"])


def test_homogeneous_cross_layer_read_is_one_descriptor_per_shuffled_block():
    lay = layout(kv_layout="cross_layer", num_layers=32, num_blocks=300)
    rng = np.random.default_rng(0)
    n = 200
    local_ids, remote_ids = rng.permutation(300)[:n], rng.permutation(300)[:n]
    desc = build_read_descriptors(whole(layers=(0, 32)), lay, 0, lay, 0, local_ids, remote_ids)
    block = 32 * 2 * lay.block_nbytes  # layers x kv x body: 2 MiB
    assert block == 2 << 20
    assert len(desc) == n
    assert set(desc.nbytes.tolist()) == {block}
    np.testing.assert_array_equal(desc.local_offsets, local_ids * block)
    np.testing.assert_array_equal(desc.remote_offsets, remote_ids * block)
    # the same request in kv_split: one 32 KiB descriptor per (layer, kv, block)
    split = layout(num_layers=32, num_blocks=300)
    assert len(build_read_descriptors(whole(layers=(0, 32)), split, 0, split, 0, local_ids,
                                      remote_ids)) == 32 * 2 * n


def test_cross_layer_consecutive_full_pools_become_one_descriptor():
    lay = layout(kv_layout="cross_layer")
    ids = np.arange(64)
    desc = build_read_descriptors(whole(), lay, 0, lay, 0, ids, ids)
    assert len(desc) == 1 and desc.nbytes[0] == lay.total_nbytes


def test_cross_layer_pp_split_reads_a_layer_range_per_block():
    # Decode holds layers [0, 4); prefill stage holds [2, 4): per block, the decode's
    # layers 2..3 (second half of its block) are one run, the whole prefill block the other.
    local = layout(kv_layout="cross_layer")
    remote = layout(kv_layout="cross_layer", num_layers=2)
    ids = np.array([5, 1, 9])
    desc = build_read_descriptors(whole(layers=(2, 4)), local, 0, remote, 2, ids, ids[::-1])
    half = 2 * 2 * local.block_nbytes
    assert len(desc) == 3 and set(desc.nbytes.tolist()) == {half}
    np.testing.assert_array_equal(desc.local_offsets, ids * 2 * half + half)
    np.testing.assert_array_equal(desc.remote_offsets, ids[::-1] * half)


def test_cross_layer_head_slice_is_one_descriptor_per_layer_kv_block():
    local = layout(kv_layout="cross_layer", num_heads=4)
    remote = layout(kv_layout="cross_layer", num_heads=8)
    read = Read(RankId(1), (4, 8), (0, 4), (4, 8), (0, 4))
    desc = build_read_descriptors(read, local, 0, remote, 0, np.arange(3), np.arange(3))
    assert len(desc) == 3 * 4 * 2
    assert set(desc.nbytes.tolist()) == {4 * 16 * 128 * 2}


@pytest.mark.parametrize("other", ["kv_split", "blocks_first"])
@pytest.mark.parametrize("cross_side", ["local", "remote"])
def test_cross_layer_mixed_with_another_layout(other, cross_side):
    """Mixed pairs stay correct; they merge only where the other side is contiguous."""
    cross, plain = layout(kv_layout="cross_layer"), layout(kv_layout=other)
    local, remote = (cross, plain) if cross_side == "local" else (plain, cross)
    ids = np.array([7, 3, 11])
    desc = build_read_descriptors(whole(), local, 0, remote, 0, ids, ids + 1)
    # K and V of one (layer, block) are adjacent in both cross_layer and blocks_first
    per = 4 if other == "blocks_first" else 4 * 2
    assert len(desc) == 3 * per
    assert desc.total_nbytes == 3 * 4 * 2 * local.block_nbytes
    # every (layer, kv, block) body lands once, at its place in each layout
    ls, rs = local.strides_nbytes(), remote.strides_nbytes()
    want = {(int(lb) * ls["block"] + layer * ls["layer"] + kv * ls["kv"],
             int(rb) * rs["block"] + layer * rs["layer"] + kv * rs["kv"])
            for lb, rb in zip(ids, ids + 1, strict=True) for layer in range(4) for kv in range(2)}
    got = set()
    body = local.block_nbytes
    for lo, ro, nb in zip(desc.local_offsets, desc.remote_offsets, desc.nbytes, strict=True):
        got |= {(int(lo) + i * body, int(ro) + i * body) for i in range(int(nb) // body)}
    assert got == want


# ---------------------------------------------------------------- head_major


def _rank_reads(model: ModelGeometry, prefill: Parallelism, decode: Parallelism, bs: int = 16,
                num_blocks: int = 300, head_dim: int = 128):
    """(decode rank, read, local layout, local first layer, remote layout, remote first)."""
    plan = plan_transfer(model, prefill, decode)

    def lay(par: Parallelism, pp_rank: int) -> tuple[CacheLayout, int]:
        l0, l1 = stage_layers(model, par, pp_rank)
        return CacheLayout(num_layers=l1 - l0, num_blocks=num_blocks, block_size_tokens=bs,
                           num_heads=heads_per_rank(model, par), head_dim=head_dim,
                           dtype_nbytes=2, kv_layout="head_major", mla=model.mla), l0

    for d_rank, reads in plan.reads.items():
        for read in reads:
            yield (d_rank, read, *lay(decode, d_rank.pp_rank),
                   *lay(prefill, read.remote.pp_rank))


def _head_body(lay: CacheLayout) -> int:
    """Bytes of one head's tokens of one (layer, kv, block)."""
    return lay.block_size_tokens * lay.head_dim * lay.dtype_nbytes


def test_head_major_shape_and_strides():
    lay = layout(kv_layout="head_major")
    assert lay.shape == (64, 8, 4, 2, 16, 128)
    assert layout(kv_layout="head_major", mla=True, num_heads=1).shape == (64, 1, 4, 1, 16, 128)
    body = 16 * 128 * 2
    assert lay.strides_nbytes() == {"layer": 2 * body, "kv": body, "head": 4 * 2 * body,
                                    "block": 8 * 4 * 2 * body, "token": 128 * 2}
    assert lay.total_nbytes == layout().total_nbytes == int(np.prod(lay.shape)) * 2
    view = np.zeros(lay.shape, dtype=np.int16)  # the strides are those of the numpy view
    s = lay.strides_nbytes()
    assert view.strides[:5] == (s["block"], s["head"], s["layer"], s["kv"], s["token"])


@pytest.mark.parametrize("kw", [{}, {"mla": True, "num_heads": 1}])
def test_head_major_refuses_nhd_in_one_line(kw):
    with pytest.raises(LayoutError, match="head_major needs head_layout HND") as info:
        layout(kv_layout="head_major", head_layout="NHD", **kw).validate()
    assert "\n" not in str(info.value)


def test_homogeneous_head_major_read_is_one_descriptor_per_shuffled_block():
    lay = layout(kv_layout="head_major", num_layers=32, num_blocks=300)
    rng = np.random.default_rng(0)
    local_ids, remote_ids = rng.permutation(300)[:200], rng.permutation(300)[:200]
    desc = build_read_descriptors(whole(layers=(0, 32)), lay, 0, lay, 0, local_ids, remote_ids)
    block = 32 * 2 * lay.block_nbytes
    assert len(desc) == 200 and set(desc.nbytes.tolist()) == {block}
    np.testing.assert_array_equal(desc.local_offsets, local_ids * block)
    np.testing.assert_array_equal(desc.remote_offsets, remote_ids * block)
    ids = np.arange(64)  # consecutive full pools: one descriptor
    small = layout(kv_layout="head_major")
    assert len(build_read_descriptors(whole(), small, 0, small, 0, ids, ids)) == 1


@pytest.mark.parametrize(("k", "tp_p", "tp_d"), [(8, 1, 2), (8, 2, 4), (8, 1, 8), (16, 2, 4)])
def test_head_major_hetero_tp_is_one_descriptor_per_block_per_decode_rank(k, tp_p, tp_d):
    """TP1 -> TP2 (and friends), N shuffled blocks: N descriptors per decode rank, each its
    heads x all layers x K/V of one block; cross_layer needs one per (layer, kv, block)."""
    model, n = ModelGeometry(k, 32), 200
    rng = np.random.default_rng(1)
    local_ids, remote_ids = rng.permutation(300)[:n], rng.permutation(300)[:n]
    per_rank: dict[RankId, int] = {}
    for d_rank, read, lay, lfirst, rlay, rfirst in _rank_reads(model, Parallelism(tp_p),
                                                               Parallelism(tp_d)):
        desc = build_read_descriptors(read, lay, lfirst, rlay, rfirst, local_ids, remote_ids)
        heads = read.heads[1] - read.heads[0]
        region = heads * 32 * 2 * _head_body(lay)
        assert heads == k // tp_d
        assert len(desc) == n and set(desc.nbytes.tolist()) == {region}
        np.testing.assert_array_equal(desc.local_offsets, local_ids * lay.strides_nbytes()["block"])
        rs = rlay.strides_nbytes()
        np.testing.assert_array_equal(
            desc.remote_offsets, remote_ids * rs["block"] + read.remote_heads[0] * rs["head"])
        per_rank[d_rank] = per_rank.get(d_rank, 0) + len(desc)
    assert per_rank == {RankId(t): n for t in range(tp_d)}


def test_head_major_pp_split_is_one_descriptor_per_block_and_head_per_stage():
    """Decode TP2 PP1 (4 layers) <- prefill TP1 PP2 (2 + 2 layers): a head's layers of one
    stage are contiguous on both sides, but the decode's heads are 4 layers apart and the
    prefill stage's 2 layers apart, so each (block, head) of each stage part is its own
    descriptor (cross_layer: one per block per stage part)."""
    model, n = ModelGeometry(8, 4), 10
    rng = np.random.default_rng(2)
    local_ids, remote_ids = rng.permutation(64)[:n], rng.permutation(64)[:n]
    reads = list(_rank_reads(model, Parallelism(1, 2), Parallelism(2), num_blocks=64))
    assert len(reads) == 2 * 2  # each decode rank reads both prefill stages
    for _, read, lay, lfirst, rlay, rfirst in reads:
        desc = build_read_descriptors(read, lay, lfirst, rlay, rfirst, local_ids, remote_ids)
        assert len(desc) == n * 4  # blocks x the decode rank's 4 heads
        assert set(desc.nbytes.tolist()) == {2 * 2 * _head_body(lay)}  # 2 layers x K/V
    # PP on the decode side only, equal heads: the decode stage's layers of every head
    # are no longer adjacent on the prefill side either
    for _, read, lay, lfirst, rlay, rfirst in _rank_reads(model, Parallelism(1),
                                                          Parallelism(1, 2), num_blocks=64):
        desc = build_read_descriptors(read, lay, lfirst, rlay, rfirst, local_ids, remote_ids)
        assert len(desc) == n * 8 and desc.total_nbytes == n * 8 * 2 * 2 * _head_body(lay)
    # the same PP on both sides: whole stages, one descriptor per block
    for _, read, lay, lfirst, rlay, rfirst in _rank_reads(model, Parallelism(1, 2),
                                                          Parallelism(1, 2), num_blocks=64):
        desc = build_read_descriptors(read, lay, lfirst, rlay, rfirst, local_ids, remote_ids)
        assert len(desc) == n


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 4), (4, 1), (4, 8)])
def test_head_major_gqa_replication_reads_one_head_region_per_block(tp_p, tp_d):
    """K=2: replicated single-head ranks on either side. Every read is one head, all
    layers and K/V of a block: one descriptor per block per read."""
    model, n = ModelGeometry(2, 6), 12
    rng = np.random.default_rng(3)
    local_ids, remote_ids = rng.permutation(40)[:n], rng.permutation(40)[:n]
    total = 0
    for _, read, lay, lfirst, rlay, rfirst in _rank_reads(model, Parallelism(tp_p),
                                                          Parallelism(tp_d), num_blocks=40):
        assert read.heads[1] - read.heads[0] == 1
        desc = build_read_descriptors(read, lay, lfirst, rlay, rfirst, local_ids, remote_ids)
        assert len(desc) == n and set(desc.nbytes.tolist()) == {6 * 2 * _head_body(lay)}
        ls, rs = lay.strides_nbytes(), rlay.strides_nbytes()
        np.testing.assert_array_equal(
            desc.local_offsets, local_ids * ls["block"] + read.local_heads[0] * ls["head"])
        np.testing.assert_array_equal(
            desc.remote_offsets, remote_ids * rs["block"] + read.remote_heads[0] * rs["head"])
        total += len(desc)
    assert total == n * max(tp_d, 2)  # one read per decode rank per head it holds


def test_head_major_mixed_with_cross_layer_is_per_head_layer_kv():
    """Mixed with cross_layer (heads innermost there), a head slice can merge nothing
    beyond one head's (layer, kv) body per block; bytes still land right (property tests)."""
    local = layout(kv_layout="head_major", num_heads=4)
    remote = layout(kv_layout="cross_layer", num_heads=8)
    read = Read(RankId(0), (4, 8), (0, 4), (4, 8), (0, 4))
    desc = build_read_descriptors(read, local, 0, remote, 0, np.arange(3), np.arange(3))
    assert len(desc) == 3 * 4 * 4 * 2 and set(desc.nbytes.tolist()) == {_head_body(local)}


def test_head_major_mla_is_one_descriptor_per_block():
    model = ModelGeometry(1, 5, mla=True)
    ids = np.array([9, 2, 5])
    for _, read, lay, lfirst, rlay, rfirst in _rank_reads(model, Parallelism(2),
                                                          Parallelism(3), num_blocks=12):
        desc = build_read_descriptors(read, lay, lfirst, rlay, rfirst, ids, ids[::-1])
        assert len(desc) == 3 and set(desc.nbytes.tolist()) == {5 * _head_body(lay)}

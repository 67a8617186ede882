"""build_read_descriptors against the plain grid-and-merge it replaced, array for array.

The fast build decides merges per axis instead of per chunk (the target: 80 layers x
4096 blocks in <= 20 ms). Its contract is the simple one kept here as `reference`: every
chunk's offsets in local memory order, padding dropped, runs contiguous on both sides
merged. Offsets, sizes and their order must come out identical, on every layout pair,
head slice, block-size ratio (partial last blocks included), layer range and id pattern.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.errors import LayoutError
from kvd.planner import (
    CacheLayout,
    Descriptors,
    RankId,
    build_read_descriptors,
    descriptor_grid,
    descriptors,
)
from kvd.planner.descriptors import _AXIS_ORDER, _check_pair, _chunking, _segments
from kvd.planner.layout import ALL_KV_LAYOUTS, VLLM_LAYOUTS, vllm_head_layout
from kvd.planner.plan import Read


def _merge(lo: np.ndarray, ro: np.ndarray, chunk_nbytes: int) -> Descriptors:
    """Collapse runs of equal-size chunks that are contiguous on both sides."""
    if lo.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    breaks = (np.diff(lo) != chunk_nbytes) | (np.diff(ro) != chunk_nbytes)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    run_chunks = np.diff(np.append(starts, lo.size))
    return Descriptors(lo[starts], ro[starts], run_chunks.astype(np.int64) * chunk_nbytes)


def reference(read: Read, local: CacheLayout, local_first_layer: int, remote: CacheLayout,
              remote_first_layer: int, local_block_ids: np.ndarray,
              remote_block_ids: np.ndarray) -> Descriptors:
    """The whole chunk grid, flattened, padding masked out, then `_merge`d (the old build)."""
    _check_pair(read, local, local_first_layer, remote, remote_first_layer)
    local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    for name, ids, lay in (("local", local_ids, local), ("remote", remote_ids, remote)):
        if ids.size and (ids.min() < 0 or ids.max() >= lay.num_blocks):
            raise LayoutError(f"{name} block id out of range [0, {lay.num_blocks})")
    if local_ids.size == 0 or remote_ids.size == 0:
        if local_ids.size != remote_ids.size:
            raise LayoutError("one side has block ids and the other has none")
        return _merge(local_ids, remote_ids, 1)
    lb, lt, rb, rt, valid, n_sub, seg_tokens = _segments(local, remote, local_ids, remote_ids)
    ls, rs = local.strides_nbytes(), remote.strides_nbytes()
    n_heads = read.local_heads[1] - read.local_heads[0]
    elem = local.channel_nbytes
    n_kv = 1 if local.vllm else local.kv_parts
    chunk, n_head_idx, n_tok = _chunking(ls, rs, elem, n_heads, seg_tokens)
    n_layers = read.layers[1] - read.layers[0]
    fold = all(s["layer"] == n_kv * chunk and (n_kv == 1 or s["kv"] == chunk)
               for s in (ls, rs))
    if fold:
        chunk *= n_layers * n_kv
    n_layer_idx, n_kv_idx = (1, 1) if fold else (n_layers, n_kv)
    n_big = lb.size // n_sub
    order = _AXIS_ORDER[local.kv_layout]
    sizes = {"layer": n_layer_idx, "kv": n_kv_idx, "big": n_big, "head": n_head_idx,
             "sub": n_sub, "tok": n_tok}

    def place(values: np.ndarray, *axes: str) -> np.ndarray:
        shape = [1] * len(order)
        for a in axes:
            shape[order.index(a)] = sizes[a]
        return values.reshape(shape)

    def grid(s: dict[str, int], first: int, blocks: np.ndarray, tokens: np.ndarray,
             heads0: int) -> np.ndarray:
        layer = (read.layers[0] - first + np.arange(n_layer_idx)) * s["layer"]
        return (place(layer, "layer") + place(np.arange(n_kv_idx) * s["kv"], "kv")
                + place(blocks * s["block"] + tokens * s["token"], "big", "sub")
                + place((heads0 + np.arange(n_head_idx)) * s["head"], "head")
                + place(np.arange(n_tok) * s["token"], "tok"))

    full = tuple(sizes[a] for a in order)
    keep = np.broadcast_to(place(valid, "big", "sub"), full).reshape(-1)
    lo = np.broadcast_to(grid(ls, local_first_layer, lb, lt, read.local_heads[0]),
                         full).reshape(-1)[keep]
    ro = np.broadcast_to(grid(rs, remote_first_layer, rb, rt, read.remote_heads[0]),
                         full).reshape(-1)[keep]
    return _merge(lo, ro, chunk)


def _head_layouts(kv_layout: str) -> list[str]:
    if kv_layout in VLLM_LAYOUTS:
        return [vllm_head_layout(kv_layout)]
    return ["HND"] if kv_layout == "head_major" else ["HND", "NHD"]


@st.composite
def cases(draw):
    mla = draw(st.booleans())
    k_local = draw(st.sampled_from(ALL_KV_LAYOUTS))
    k_remote = k_local if draw(st.booleans()) else draw(st.sampled_from(ALL_KV_LAYOUTS))
    h_local = draw(st.sampled_from(_head_layouts(k_local)))
    h_remote = draw(st.sampled_from(_head_layouts(k_remote)))
    if h_remote != h_local and h_local in _head_layouts(k_remote) and draw(st.booleans()):
        h_remote = h_local
    n_read_heads = 1 if mla else draw(st.integers(1, 4))
    heads_l = n_read_heads + (0 if mla else draw(st.integers(0, 3)))
    heads_r = n_read_heads + (0 if mla else draw(st.integers(0, 3)))
    lh0 = draw(st.integers(0, heads_l - n_read_heads))
    rh0 = draw(st.integers(0, heads_r - n_read_heads))
    layers_l, layers_r = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    first_l, first_r = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    lo_layer = max(first_l, first_r)
    hi_layer = min(first_l + layers_l, first_r + layers_r)
    if lo_layer >= hi_layer:  # disjoint stages: make the remote's cover the local's
        first_r, layers_r = first_l, layers_l
        lo_layer, hi_layer = first_l, first_l + layers_l
    l0 = draw(st.integers(lo_layer, hi_layer - 1))
    l1 = draw(st.integers(l0 + 1, hi_layer))
    base = draw(st.sampled_from([1, 2, 4]))
    ratio = draw(st.sampled_from([1, 1, 2, 4]))
    bs_l, bs_r = (base * ratio, base) if draw(st.booleans()) else (base, base * ratio)
    tokens = draw(st.integers(1, 24))
    n_l, n_r = -(-tokens // bs_l), -(-tokens // bs_r)
    spare = draw(st.integers(0, 3))
    pattern = draw(st.sampled_from(["shuffled", "consecutive", "runs"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def ids(n: int, pool: int) -> np.ndarray:
        if pattern == "consecutive":
            start = int(rng.integers(0, pool - n + 1))
            return np.arange(start, start + n)
        if pattern == "runs":  # runs of consecutive ids in shuffled order: partial merges
            cuts = np.flatnonzero(rng.integers(0, 3, pool - 1) == 0) + 1
            runs = np.split(np.arange(pool), cuts)
            return np.concatenate([runs[i] for i in rng.permutation(len(runs))])[:n]
        return rng.permutation(pool)[:n]

    head_dim = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([1, 2]))
    local = CacheLayout(layers_l, n_l + spare, bs_l, heads_l, head_dim, dtype,
                        kv_layout=k_local, head_layout=h_local, mla=mla)
    remote = CacheLayout(layers_r, n_r + spare, bs_r, heads_r, head_dim, dtype,
                         kv_layout=k_remote, head_layout=h_remote, mla=mla)
    read = Read(RankId(0, 0), (rh0, rh0 + n_read_heads), (lh0, lh0 + n_read_heads),
                (rh0, rh0 + n_read_heads), (l0, l1))
    local_ids = ids(n_l, n_l + spare)
    remote_ids = ids(n_r, n_r + spare)
    return read, local, first_l, remote, first_r, local_ids, remote_ids


def _same(a: Descriptors, b: Descriptors) -> None:
    for name in ("local_offsets", "remote_offsets", "nbytes"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == np.int64 and x.ndim == 1, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def _both_paths(*args) -> list[Descriptors]:
    """The build as small requests get it (flat merge) and as big ones do (per axis, the
    short-last-axis grids in whole and in tiles of one row)."""
    out = [build_read_descriptors(*args)]
    with mock.patch.object(descriptors, "SMALL_GRID", -1):
        out.append(build_read_descriptors(*args))
        with mock.patch.object(descriptor_grid, "_TILE", 8):
            out.append(build_read_descriptors(*args))
    return out


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fast_build_equals_the_reference(case):
    try:
        expected = reference(*case)
    except LayoutError as e:
        with pytest.raises(LayoutError) as got:
            build_read_descriptors(*case)
        assert str(got.value) == str(e)
        return
    for got in _both_paths(*case):
        _same(got, expected)


@pytest.mark.parametrize("kv_layout", ALL_KV_LAYOUTS)
@pytest.mark.parametrize("bs", [(16, 16), (64, 16), (16, 64)])
@pytest.mark.parametrize("ids", ["consecutive", "shuffled", "partial"])
def test_bench_shaped_cases_equal_the_reference(kv_layout, bs, ids):
    """The benchmark's shapes, scaled down: 6 layers, 8 heads, 4-of-8 slices, both ratios."""
    rng = np.random.default_rng(7)
    head_layout = _head_layouts(kv_layout)[-1]  # NHD where there is one
    tokens = 16 * 24 - (5 if ids == "partial" else 0)
    for read_heads, local_heads in (((0, 8), 8), ((4, 8), 4)):
        if head_layout == "NHD" and kv_layout not in VLLM_LAYOUTS and local_heads != 8:
            continue  # head-sliced split-layout NHD is refused
        layouts = [CacheLayout(6, 64 * 16 // b, b, h, 4, 2, kv_layout=kv_layout,
                               head_layout=head_layout) for b, h in zip(bs, (local_heads, 8),
                                                                        strict=True)]
        counts = [-(-tokens // lay.block_size_tokens) for lay in layouts]
        if ids == "consecutive":
            tables = [np.arange(3, 3 + n) for n in counts]
        else:
            tables = [rng.permutation(lay.num_blocks)[:n] for lay, n in zip(layouts, counts,
                                                                             strict=True)]
        local_range = (read_heads[0] - (8 - local_heads), read_heads[1] - (8 - local_heads))
        read = Read(RankId(0, 0), read_heads, local_range, read_heads, (1, 5))
        args = (read, layouts[0], 0, layouts[1], 1, tables[0], tables[1])
        expected = reference(*args)
        for got in _both_paths(*args):
            _same(got, expected)

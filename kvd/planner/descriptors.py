"""From a planned Read to byte ranges: NIXL descriptors between two KV pools.

Descriptor size decides transfer speed (4 KiB descriptors move ~10x slower than
1 MiB ones), so the output is merged: every run of chunks that is contiguous on
both sides becomes one descriptor. Chunks are emitted in the local pool's
memory order, which is what makes neighbours adjacent for the merge. The byte
layouts themselves (strides per kv_layout) are kvd.planner.layout.CacheLayout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError
from kvd.planner.descriptor_grid import (
    SMALL_GRID,
    close_padding,
    count_merges,
    drop_merged,
    fold_axis,
    grid,
    level_breaks,
    merge_chunks,
    merge_positions,
    run_nbytes,
)
from kvd.planner.layout import CacheLayout
from kvd.planner.plan import Read


@dataclass(frozen=True)
class Descriptors:
    """Parallel arrays of byte ranges: local (decode) and remote (prefill) offsets."""

    local_offsets: np.ndarray  # int64
    remote_offsets: np.ndarray  # int64
    nbytes: np.ndarray  # int64; read-only where every size is equal (see equal_sizes)

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())


def equal_sizes(n: int, chunk: int) -> np.ndarray:
    """n sizes of `chunk` bytes as a read-only broadcast view of one int64.

    Why not np.full: at 5M descriptors that is 42 MB of fresh pages, ~5 ms of a 20 ms
    budget (first touches, not the writes). Every consumer only reads sizes (sums, gcds,
    copies into NIXL's rows, concatenation), and sizes may already be read-only (the
    one-block templates of kvd.planner.assembly); a caller that must write copies first.
    """
    return np.broadcast_to(np.array(chunk, dtype=np.int64), (n,))


def _check_pair(read: Read, local: CacheLayout, local_first_layer: int,
                remote: CacheLayout, remote_first_layer: int) -> None:
    local.validate()
    remote.validate()
    if local.mla != remote.mla:
        raise LayoutError("cannot pair an MLA cache with a non-MLA cache")
    if local.head_dim != remote.head_dim:
        raise LayoutError(f"head_dim differs: local {local.head_dim}, remote {remote.head_dim}")
    if local.dtype_nbytes != remote.dtype_nbytes:
        raise LayoutError(
            f"dtype size differs: local {local.dtype_nbytes} B, remote {remote.dtype_nbytes} B"
        )
    (lh0, lh1), (rh0, rh1) = read.local_heads, read.remote_heads
    if not (0 <= lh0 < lh1 <= local.num_heads) or not (0 <= rh0 < rh1 <= remote.num_heads):
        raise LayoutError(
            f"read heads local {read.local_heads} / remote {read.remote_heads} do not fit "
            f"caches of {local.num_heads} / {remote.num_heads} heads"
        )
    if lh1 - lh0 != rh1 - rh0:
        raise LayoutError(
            f"read head ranges differ in size: {read.local_heads} vs {read.remote_heads}"
        )
    l0, l1 = read.layers
    if not (local_first_layer <= l0 < l1 <= local_first_layer + local.num_layers):
        raise LayoutError(f"read layers {read.layers} are not all in the local cache")
    if not (remote_first_layer <= l0 < l1 <= remote_first_layer + remote.num_layers):
        raise LayoutError(f"read layers {read.layers} are not all in the remote cache")
    if not local.mla and local.vllm != remote.vllm:
        v, other = (local, remote) if local.vllm else (remote, local)
        raise LayoutError(
            f"K and V sit side by side in {v.kv_layout} but apart in {other.kv_layout}: "
            "bytes would need de-interleaving"
        )
    if local.vllm or remote.vllm:
        # A single-head side has one order; any other pair of orders needs a transpose.
        if (local.num_heads > 1 and remote.num_heads > 1
                and local.effective_head_layout != remote.effective_head_layout):
            raise LayoutError(
                f"head layouts differ (local {local.kv_layout}, remote {remote.kv_layout}): "
                "bytes would need a transpose"
            )
        return  # token-major (NH) head slices: one descriptor per token, see _chunking
    if local.effective_head_layout != remote.effective_head_layout:
        raise LayoutError(
            f"head layouts differ (local {local.head_layout}, remote {remote.head_layout}): "
            "bytes would need a transpose"
        )
    whole = read.local_heads == (0, local.num_heads) and read.remote_heads == (0, remote.num_heads)
    if local.effective_head_layout == "NHD" and not whole:
        raise LayoutError(
            "NHD caches cannot be head-sliced with byte-range descriptors; "
            "use HND or equal TP (whole-head reads)"
        )


def _chunking(ls: dict[str, int], rs: dict[str, int], elem: int, n_heads: int,
              seg_tokens: int) -> tuple[int, int, int]:
    """(chunk bytes, head-axis size, token-axis size): the biggest piece both sides hold
    contiguously in the same order, of one (layer, kv, segment).

    Decided by strides, not names, so that every pair of layouts (one of them with a
    single head included) gets the same test: a segment's heads x tokens as one run,
    token-major or head-major; else one head's tokens; else one token's heads (vLLM's
    NH layouts cut to a head range: one descriptor per token).
    """
    sides = (ls, rs)
    heads_run = n_heads == 1 or all(s["head"] == elem for s in sides)
    tokens_run = all(s["token"] == elem for s in sides)
    if heads_run and all(s["token"] == n_heads * elem for s in sides):  # [token][head]
        return n_heads * seg_tokens * elem, 1, 1
    if tokens_run and (n_heads == 1 or all(s["head"] == seg_tokens * elem for s in sides)):
        return n_heads * seg_tokens * elem, 1, 1  # [head][token]
    if tokens_run:
        return seg_tokens * elem, n_heads, 1
    if heads_run:
        return n_heads * elem, 1, seg_tokens
    raise LayoutError("the two caches order heads and tokens differently: no byte-range form")


def _segments(local: CacheLayout, remote: CacheLayout, local_ids: np.ndarray,
              remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                               np.ndarray, np.ndarray, int, int]:
    """Pair token segments of min(block sizes) tokens between the two sides.

    Segments are indexed (bigger block, sub-segment) so the caller can put the
    head axis between them; a partial last big block is padded and the
    returned `valid` mask drops the padding. Returns (local block, local token
    offset, remote block, remote token offset, valid, n_sub, segment tokens).
    """
    bs_l, bs_r = local.block_size_tokens, remote.block_size_tokens
    if max(bs_l, bs_r) % min(bs_l, bs_r):
        raise LayoutError(f"block sizes {bs_l} (local) and {bs_r} (remote) do not divide")
    if bs_l >= bs_r:  # local blocks are the big ones: remote j -> local j // n
        n = bs_l // bs_r
        if -(-len(remote_ids) // n) != len(local_ids):
            raise LayoutError(
                f"{len(remote_ids)} remote blocks of {bs_r} tokens do not fill "
                f"{len(local_ids)} local blocks of {bs_l} tokens"
            )
        j = np.arange(len(local_ids) * n)
        valid = j < len(remote_ids)
        rb = remote_ids[np.minimum(j, max(len(remote_ids) - 1, 0))]
        return local_ids[j // n], (j % n) * bs_r, rb, np.zeros_like(j), valid, n, bs_r
    m = bs_r // bs_l  # remote blocks are the big ones: local k <- remote k // m
    if -(-len(local_ids) // m) != len(remote_ids):
        raise LayoutError(
            f"{len(local_ids)} local blocks of {bs_l} tokens do not match "
            f"{len(remote_ids)} remote blocks of {bs_r} tokens"
        )
    k = np.arange(len(remote_ids) * m)
    valid = k < len(local_ids)
    lb = local_ids[np.minimum(k, max(len(local_ids) - 1, 0))]
    return lb, np.zeros_like(k), remote_ids[k // m], (k % m) * bs_l, valid, m, bs_l


# Chunk enumeration order per local kv_layout, outermost first: its memory order.
# "big"/"sub" are the segment (bigger block, sub-segment), "tok" a token inside it.
_AXIS_ORDER = {
    "kv_split": ("layer", "kv", "big", "head", "sub", "tok"),
    "blocks_first": ("layer", "big", "kv", "head", "sub", "tok"),
    "cross_layer": ("big", "layer", "kv", "head", "sub", "tok"),
    "head_major": ("big", "head", "layer", "kv", "sub", "tok"),
    "LBHNC": ("layer", "kv", "big", "head", "sub", "tok"),
    "LBNHC": ("layer", "kv", "big", "sub", "tok", "head"),
    "LHBNC": ("layer", "kv", "head", "big", "sub", "tok"),
    "BLHNC": ("big", "layer", "kv", "head", "sub", "tok"),
    "BLNHC": ("big", "layer", "kv", "sub", "tok", "head"),
    "BHLNC": ("big", "head", "layer", "kv", "sub", "tok"),
}


def _split_segments(seg: np.ndarray, big: int, sub: int) -> list[np.ndarray]:
    """The segment table (axes `big` and `sub`) as a big-only plus a sub-only term where
    it is one: on the side with the bigger blocks (a block's base plus the sub-segment's
    token offset) and wherever a side's ids are consecutive. Then no term straddles the
    axes between "big" and "sub" and _outer_sum can cut there.
    """
    if seg.shape[big] == 1 or seg.shape[sub] == 1:
        return [seg]
    first = tuple(slice(0, 1) if d in (big, sub) else slice(None) for d in range(seg.ndim))
    per_big = seg[tuple(slice(0, 1) if d == sub else slice(None) for d in range(seg.ndim))]
    per_sub = seg[tuple(slice(0, 1) if d == big else slice(None) for d in range(seg.ndim))]
    per_sub = per_sub - seg[first]
    if np.array_equal(per_big + per_sub, seg):
        return [per_big, per_sub]
    return [seg]


def build_read_descriptors(read: Read, local: CacheLayout, local_first_layer: int,
                           remote: CacheLayout, remote_first_layer: int,
                           local_block_ids: np.ndarray,
                           remote_block_ids: np.ndarray) -> Descriptors:
    """Byte ranges that move one Read's cells of one request into the decode pool.

    Chunks are one (layer, kv, segment) when the head range is contiguous on
    both sides (HND with equal block sizes, or whole-head NHD), else one
    (layer, kv, segment, head) (always when a side is head_major; both
    head_major with equal block sizes: one (head, block) spanning the read's
    layers and K/V); the axis order follows the local pool so that the merge
    finds its neighbours. Both cross_layer (or both head_major), equal block
    sizes and a read of all layers and heads of both ranks: one descriptor per
    block (or per run of consecutive blocks). Both head_major and all layers
    of both ranks: one descriptor per block for any head range (a TP1 -> TP2
    pull included). vLLM's layouts go through the same path with K||V as the
    element (`_chunking` decides by strides); BHLNC behaves as head_major, and
    an NH name (LBNHC, BLNHC) cut to a head range is one descriptor per token.

    The result is exactly the run-merge of the chunk grid in local memory order
    (`merge_chunks` of the flat grid); it is computed per axis, not per chunk, see
    `_level_delta`, so a request of 80 layers x 4096 blocks costs a few passes
    over its output and nothing per chunk in Python.
    """
    _check_pair(read, local, local_first_layer, remote, remote_first_layer)
    local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    for name, ids, lay in (("local", local_ids, local), ("remote", remote_ids, remote)):
        if ids.size and (ids.min() < 0 or ids.max() >= lay.num_blocks):
            raise LayoutError(f"{name} block id out of range [0, {lay.num_blocks})")
    if local_ids.size == 0 or remote_ids.size == 0:
        if local_ids.size != remote_ids.size:
            raise LayoutError("one side has block ids and the other has none")
        return Descriptors(*merge_chunks(local_ids, remote_ids, 1))

    lb, lt, rb, rt, valid, n_sub, seg_tokens = _segments(local, remote, local_ids, remote_ids)
    ls, rs = local.strides_nbytes(), remote.strides_nbytes()
    n_heads = read.local_heads[1] - read.local_heads[0]
    # vLLM layouts carry K and V inside the channel (one kv index); MLA pairs of a vLLM
    # and a split layout agree anyway: one part, channel == head_dim.
    elem = local.channel_nbytes
    n_kv = 1 if local.vllm else local.kv_parts
    chunk, n_head_idx, n_tok = _chunking(ls, rs, elem, n_heads, seg_tokens)

    n_layers = read.layers[1] - read.layers[0]
    # Where a chunk's K/V parts and layers follow each other on both sides (head_major or
    # BHLNC with equal block sizes: one head's layer range x K/V x tokens) take them as one
    # chunk from the start: n_layers * n_kv fewer chunks to merge.
    fold = all(s["layer"] == n_kv * chunk and (n_kv == 1 or s["kv"] == chunk)
               for s in (ls, rs))
    if fold:
        chunk *= n_layers * n_kv
    n_layer_idx, n_kv_idx = (1, 1) if fold else (n_layers, n_kv)
    n_big = lb.size // n_sub

    # Enumerate chunks in the local pool's memory order so that neighbours in memory
    # are neighbours in the list. Any order is correct (each chunk pairs the same
    # (layer, kv, segment, head) on both sides); only the merge depends on it.
    order = _AXIS_ORDER[local.kv_layout]
    pos = {a: i for i, a in enumerate(order)}
    sizes = [{"layer": n_layer_idx, "kv": n_kv_idx, "big": n_big, "head": n_head_idx,
              "sub": n_sub, "tok": n_tok}[a] for a in order]

    def place(values: np.ndarray, *axes: str) -> np.ndarray:
        # "big" precedes "sub" in every order, so a C-order (big, sub) array reshapes in place
        shape = [1] * len(order)
        for a in axes:
            shape[pos[a]] = sizes[pos[a]]
        return values.reshape(shape)

    # Small grids (a short request): the per-axis bookkeeping below costs more Python than
    # it saves; sum the terms over the grid and merge it flat.
    small = math.prod(sizes) <= SMALL_GRID
    sides = []
    for s, first, blocks, tokens, heads0 in (
        (ls, local_first_layer, lb, lt, read.local_heads[0]),
        (rs, remote_first_layer, rb, rt, read.remote_heads[0]),
    ):
        seg = place(blocks * s["block"] + tokens * s["token"], "big", "sub")
        sides.append([
            place((read.layers[0] - first + np.arange(n_layer_idx, dtype=np.int64))
                  * s["layer"], "layer"),
            place(np.arange(n_kv_idx, dtype=np.int64) * s["kv"], "kv"),
            *([seg] if small else _split_segments(seg, pos["big"], pos["sub"])),
            place((heads0 + np.arange(n_head_idx, dtype=np.int64)) * s["head"], "head"),
            place(np.arange(n_tok, dtype=np.int64) * s["token"], "tok"),
        ])
    lo_terms, ro_terms = sides
    padded = not valid.all()  # a partial last big block: its missing segments drop out
    if small:
        lo = (lo_terms[0] + lo_terms[1]) + lo_terms[2] + lo_terms[3] + lo_terms[4]
        ro = (ro_terms[0] + ro_terms[1]) + ro_terms[2] + ro_terms[3] + ro_terms[4]
        lo, ro = np.broadcast_to(lo, sizes).reshape(-1), np.broadcast_to(ro, sizes).reshape(-1)
        if padded:
            keep = np.broadcast_to(place(valid, "big", "sub"), sizes).reshape(-1)
            lo, ro = lo[keep], ro[keep]
        return Descriptors(*merge_chunks(lo, ro, chunk))

    # Fold every innermost axis whose steps all merge (a whole line is one chunk). Padding
    # sits on (big, sub): with it, no line may span "sub" or anything outside it.
    breaks: dict[int, np.ndarray] = {}
    for k in reversed(range(len(order))):
        if sizes[k] == 1:
            continue
        if padded and k <= pos["sub"]:
            break
        brk = level_breaks(lo_terms, ro_terms, sizes, k, chunk)
        if brk.any():
            breaks[k] = brk
            break
        chunk *= sizes[k]
        fold_axis(lo_terms, ro_terms, sizes, k)
    for k in range(len(order)):
        if sizes[k] > 1 and k not in breaks:
            breaks[k] = level_breaks(lo_terms, ro_terms, sizes, k, chunk)

    lo, ro = grid(lo_terms, sizes), grid(ro_terms, sizes)
    n = lo.size
    if not padded:
        merges = sum(count_merges(brk, sizes, k) for k, brk in breaks.items())
        if merges == 0:  # no step of any level merges: every chunk is a descriptor
            return Descriptors(lo, ro, equal_sizes(n, chunk))
        if merges <= n // 8:  # a few: list them instead of masking the grid
            return Descriptors(*drop_merged(lo, ro, merge_positions(breaks, sizes), None, chunk))
    else:
        merges = sum(count_merges(brk, sizes, k) for k, brk in breaks.items())
        valid_subs = int(np.count_nonzero(valid)) - (n_big - 1) * n_sub
        if merges <= n // 8:
            return Descriptors(*close_padding(lo, ro, breaks, sizes, pos["big"], pos["sub"],
                                           valid_subs, chunk))
    starts_mask = np.empty(sizes, dtype=bool)
    starts_mask.reshape(-1)[0] = True
    for k, brk in breaks.items():  # level k: index >= 1 on axis k, 0 on every axis inside it
        tail = (slice(0, 1),) * (len(order) - k - 1)
        starts_mask[(slice(None),) * k + (slice(1, None),) + tail] = brk
    starts_mask = starts_mask.reshape(-1)
    if not padded:
        starts = np.flatnonzero(starts_mask)
        return Descriptors(lo[starts], ro[starts], run_nbytes(starts, n, chunk))
    # Padding: drop the missing segments, then re-decide each chunk that followed a gap
    # against the chunk kept before the gap.
    kept = np.flatnonzero(np.broadcast_to(place(valid, "big", "sub"), sizes).reshape(-1))
    mask = starts_mask[kept]
    after_gap = np.flatnonzero(np.diff(kept) > 1) + 1
    if after_gap.size:
        cur, prev = kept[after_gap], kept[after_gap - 1]
        mask[after_gap] = (lo[cur] - lo[prev] != chunk) | (ro[cur] - ro[prev] != chunk)
    starts = np.flatnonzero(mask)
    at = kept[starts]
    return Descriptors(lo[at], ro[at], run_nbytes(starts, kept.size, chunk))

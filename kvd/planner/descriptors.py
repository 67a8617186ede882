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
from kvd.planner.layout import CacheLayout
from kvd.planner.plan import Read


@dataclass(frozen=True)
class Descriptors:
    """Parallel arrays of byte ranges: local (decode) and remote (prefill) offsets."""

    local_offsets: np.ndarray  # int64
    remote_offsets: np.ndarray  # int64
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())


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


def _merge(lo: np.ndarray, ro: np.ndarray, chunk_nbytes: int) -> Descriptors:
    """Collapse runs of equal-size chunks that are contiguous on both sides."""
    if lo.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    starts = np.empty(lo.size, dtype=bool)
    starts[0] = True
    np.not_equal(lo[1:] - lo[:-1], chunk_nbytes, out=starts[1:])
    starts[1:] |= ro[1:] - ro[:-1] != chunk_nbytes
    at = np.flatnonzero(starts)
    return Descriptors(lo[at], ro[at], _run_nbytes(at, lo.size, chunk_nbytes))


# The chunk grid. Offsets of chunk (i_0 .. i_5), axes in _AXIS_ORDER, on one side are a
# sum of terms: one per regular axis (layer, kv, head, tok: a start plus a stride) and the
# segment table over (big, sub). Each term is kept as a 6-d array, size 1 on the axes it
# does not vary along, so that numpy broadcasting lays it on the grid.
#
# Why not build the whole grid and np.diff it: a chunk i follows chunk i - 1 in memory iff
# their offsets differ by the chunk size on both sides, and that difference depends only
# on the innermost axis k whose index is not 0 in i (the "level" of i: axis k stepped, the
# axes inside it wrapped from their last index to 0) and on that step's index (plus the
# big index where the segment table is cut by k). So the merge is decided on arrays of
# the size of one axis (or of the segment table), not of the grid: axes whose every step
# merges fold into the chunk, and when no step can merge, the grid is the answer as is.


def _level_delta(terms: list[np.ndarray], sizes: list[int], k: int) -> np.ndarray | int:
    """Offset difference of every chunk of level k from its predecessor, on one side.

    Shaped (sizes[0], .., sizes[k-1], sizes[k] - 1, 1, ..) (or 1 where no term varies);
    axes > k are at index 0 (after the step) and at their last index (before it).
    """
    delta: np.ndarray | int = 0
    nd = len(sizes)
    for t in terms:
        shape = t.shape
        vary = [d for d in range(nd) if shape[d] > 1]
        if not vary or vary[-1] < k:
            continue  # constant across this step: cancels
        if len(vary) == 1:  # one axis (most terms): 1-d arithmetic, no index tuples
            v = t.reshape(-1)
            if vary[0] > k:  # wraps from its last index to 0
                delta = delta + (int(v[0]) - int(v[-1]))
            else:  # steps
                delta = delta + (v[1:] - v[:-1]).reshape(shape[:k] + (shape[k] - 1,)
                                                         + shape[k + 1:])
            continue
        new, old = [], []
        for d in range(nd):
            if d < k or shape[d] == 1:
                new.append(slice(None))
                old.append(slice(None))
            elif d == k:
                new.append(slice(1, None))
                old.append(slice(None, -1))
            else:
                new.append(slice(0, 1))
                old.append(slice(-1, None))
        delta = delta + (t[tuple(new)] - t[tuple(old)])
    return delta


def _level_breaks(lo_terms: list[np.ndarray], ro_terms: list[np.ndarray], sizes: list[int],
                  k: int, chunk: int) -> np.ndarray:
    """True where a chunk of level k does not continue its predecessor on some side."""
    brk = np.asarray((_level_delta(lo_terms, sizes, k) != chunk)
                     | (_level_delta(ro_terms, sizes, k) != chunk))
    return brk.reshape((1,) * len(sizes)) if brk.ndim == 0 else brk


def _count_merges(brk: np.ndarray, sizes: list[int], k: int) -> int:
    """How many chunks of level k continue their predecessor (brk broadcasts over the
    axes where it has size 1)."""
    mult = 1
    for d in range(k + 1):
        if brk.shape[d] == 1:
            mult *= sizes[d] - 1 if d == k else sizes[d]
    return (brk.size - int(np.count_nonzero(brk))) * mult


def _merge_positions(breaks: dict[int, np.ndarray], sizes: list[int]) -> np.ndarray:
    """Sorted flat grid positions of the chunks that continue their predecessor."""
    strides = [int(np.prod(sizes[d + 1:])) for d in range(len(sizes))]
    parts = []
    for k, brk in breaks.items():
        idx = np.nonzero(~brk)
        pos = np.zeros(idx[0].size, dtype=np.int64)
        for d in range(k + 1):
            if brk.shape[d] > 1:
                pos += (idx[d] + (d == k)) * strides[d]
        for d in range(k + 1):  # the axes brk broadcasts over: every index
            if brk.shape[d] == 1 and sizes[d] > 1:
                steps = np.arange(1 if d == k else 0, sizes[d], dtype=np.int64) * strides[d]
                pos = (pos[:, None] + steps[None, :]).reshape(-1)
        parts.append(pos)
    return np.sort(np.concatenate(parts))


def _drop(lo: np.ndarray, ro: np.ndarray, dropped: np.ndarray, merged: np.ndarray | None,
          chunk: int) -> Descriptors:
    """The grid less the chunks at `dropped` (sorted positions, a few): those flagged in
    `merged` (all when None) continue the descriptor before them and add their bytes to
    it, the others (padding) vanish.

    A handful of positions are closed up in place (no fresh n-sized copies: first
    touches of fresh pages are most of the cost at these sizes); more go through a mask.
    """
    n, m = lo.size, dropped.size
    if m <= max(64, n // 1024):
        bounds = [*dropped.tolist(), n]
        for j in range(m):  # 1-d forward copies onto lower addresses: numpy memmoves them
            src, end = bounds[j] + 1, bounds[j + 1]
            lo[src - j - 1:end - j - 1] = lo[src:end]
            ro[src - j - 1:end - j - 1] = ro[src:end]
        lo, ro = lo[:n - m], ro[:n - m]
    else:
        keep = np.ones(n, dtype=bool)
        keep[dropped] = False
        lo, ro = lo[keep], ro[keep]
    # the descriptor before dropped[j] has output index dropped[j] - j - 1
    into = dropped - np.arange(1, m + 1)
    if merged is not None:
        into = into[merged]
    nbytes = np.bincount(into, minlength=n - m).astype(np.int64, copy=False)
    nbytes += 1
    nbytes *= chunk
    return Descriptors(lo, ro, nbytes)


def _padding_positions(sizes: list[int], big: int, sub: int, valid_subs: int) -> np.ndarray:
    """Sorted flat positions of the last big block's missing sub-segments (sub index >=
    valid_subs): every index on the other axes."""
    strides = [int(np.prod(sizes[d + 1:])) for d in range(len(sizes))]
    pos = np.zeros((1,) * len(sizes), dtype=np.int64)
    for d, n in enumerate(sizes):
        if d == big:
            steps = np.array([(n - 1) * strides[d]], dtype=np.int64)
        elif d == sub:
            steps = np.arange(valid_subs, n, dtype=np.int64) * strides[d]
        else:
            steps = np.arange(n, dtype=np.int64) * strides[d]
        shape = [1] * len(sizes)
        shape[d] = steps.size
        pos = pos + steps.reshape(shape)
    return pos.reshape(-1)  # C order over positive strides: already sorted


def _padded(lo: np.ndarray, ro: np.ndarray, breaks: dict[int, np.ndarray], sizes: list[int],
            big: int, sub: int, valid_subs: int, chunk: int) -> Descriptors:
    """A grid whose last big block has only `valid_subs` sub-segments: drop the others,
    and re-decide each chunk right after a dropped run against the chunk before the run
    (the levels' breaks compared it with a padding chunk)."""
    pad = _padding_positions(sizes, big, sub, valid_subs)
    run_end = np.flatnonzero(np.diff(pad) != 1)
    last = np.append(pad[run_end], pad[-1])  # each dropped run's last position
    first = np.insert(pad[run_end + 1], 0, pad[0])
    after, before = last + 1, first - 1
    inside = after < lo.size
    after, before = after[inside], before[inside]
    joins = after[(lo[after] - lo[before] == chunk) & (ro[after] - ro[before] == chunk)]
    merged = _merge_positions(breaks, sizes)
    stale = np.concatenate((pad, after))
    merged = merged[~np.isin(merged, stale, assume_unique=False)]
    dropped = np.concatenate((pad, merged, joins))
    flags = np.zeros(dropped.size, dtype=bool)
    flags[pad.size:] = True
    order = np.argsort(dropped, kind="stable")
    return _drop(lo, ro, dropped[order], flags[order], chunk)


def _fold(lo_terms: list[np.ndarray], ro_terms: list[np.ndarray], sizes: list[int], k: int
          ) -> None:
    """Axis k's lines become single chunks: keep each term's index 0 along k (in place)."""
    cut = (slice(None),) * k + (slice(0, 1),)
    for terms in (lo_terms, ro_terms):
        terms[:] = [t[cut] if t.shape[k] > 1 else t for t in terms]
    sizes[k] = 1


_SMALL_GRID = 1 << 14  # chunks up to which build_read_descriptors merges the flat grid
_SHORT = 16  # a last axis shorter than this makes numpy's broadcast loop slow
_TILE = 1 << 18  # chunks per row tile in _outer_sum's short-axis path (2 MiB of int64)


def _outer_sum(terms: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Sum of broadcastable terms over `shape`, C order, as a fresh array of that shape.

    numpy's broadcasting runs its inner loop over the last axis only, and here that axis
    is often 2 to 16 long (kv, sub-blocks, tokens): 5M chunks would cost 1M+ inner-loop
    calls. So split the axes where no term straddles the cut, sum each side on its own
    (recursively, small), and write the grid once as outer[:, None] + inner[None, :],
    whose inner loop is the whole inner side.
    """
    out = np.empty(shape, dtype=np.int64)
    if not terms:
        out.fill(0)
        return out
    spans = [[d for d in range(len(shape)) if t.shape[d] > 1] for t in terms]
    for cut in range(1, len(shape)):
        if all(not sp or sp[-1] < cut or sp[0] >= cut for sp in spans):
            outer = [t for t, sp in zip(terms, spans, strict=True) if not sp or sp[-1] < cut]
            inner = [t for t, sp in zip(terms, spans, strict=True) if sp and sp[0] >= cut]
            if outer and inner:
                a = _outer_sum([t.reshape(t.shape[:cut]) for t in outer], shape[:cut])
                b = _outer_sum([t.reshape(t.shape[cut:]) for t in inner], shape[cut:])
                np.add(a.reshape(-1, 1), b.reshape(1, -1), out=out.reshape(a.size, b.size))
                return out
    terms = sorted(terms, key=lambda t: t.size)
    acc = terms[0]
    for t in terms[1:-1]:
        acc = acc + t
    if len(terms) == 1:
        out[...] = acc
        return out
    big = terms[-1]
    if len(shape) < 2 or shape[-1] >= _SHORT or out.size < _TILE:
        np.add(acc, big, out=out)
        return out
    # No cut and a short last axis (a segment table cut by the axes between "big" and
    # "sub"): write one last-axis index at a time, numpy then coalesces the axes above
    # into one long inner loop; in row tiles of ~_TILE chunks so that the strided
    # writes stay in cache.
    rows = max(1, _TILE // (out.size // shape[0]))

    def at(t: np.ndarray, r0: int, s: int) -> np.ndarray:
        lead = slice(r0, r0 + rows) if t.shape[0] > 1 else slice(None)
        return t[(lead,) + (slice(None),) * (len(shape) - 2) + (s if t.shape[-1] > 1 else 0,)]

    for r0 in range(0, shape[0], rows):
        tile = out[r0:r0 + rows]
        for s in range(shape[-1]):
            np.add(at(acc, r0, s), at(big, r0, s), out=tile[..., s])
    return out


def _grid(terms: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """One side's chunk offsets, C order over the grid, as a fresh flat int64 array."""
    keep = [d for d in range(len(sizes)) if sizes[d] > 1]
    const = 0
    arrays = []
    for t in terms:
        if t.size == 1:
            const += int(t.reshape(-1)[0])  # constant terms: one scalar added to the smallest
        else:
            arrays.append(t.reshape(tuple(t.shape[d] for d in keep)))
    if const:
        if arrays:
            i = min(range(len(arrays)), key=lambda j: arrays[j].size)
            arrays[i] = arrays[i] + const
        else:
            arrays.append(np.full((1,) * len(keep), const, dtype=np.int64))
    return _outer_sum(arrays, tuple(sizes[d] for d in keep)).reshape(-1)


def _run_nbytes(starts: np.ndarray, n: int, chunk: int) -> np.ndarray:
    """Bytes of each run of chunks starting at `starts` (sorted, starts[0] == 0) out of n.

    By hand: np.diff(starts, append=n) costs ~10x more (it concatenates first).
    """
    out = np.empty(starts.size, dtype=np.int64)
    np.subtract(starts[1:], starts[:-1], out=out[:-1])
    out[-1] = n - starts[-1]
    out *= chunk
    return out


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
    (`_merge` of the flat grid); it is computed per axis, not per chunk, see
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
        return _merge(local_ids, remote_ids, 1)

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
    small = math.prod(sizes) <= _SMALL_GRID
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
        return _merge(lo, ro, chunk)

    # Fold every innermost axis whose steps all merge (a whole line is one chunk). Padding
    # sits on (big, sub): with it, no line may span "sub" or anything outside it.
    breaks: dict[int, np.ndarray] = {}
    for k in reversed(range(len(order))):
        if sizes[k] == 1:
            continue
        if padded and k <= pos["sub"]:
            break
        brk = _level_breaks(lo_terms, ro_terms, sizes, k, chunk)
        if brk.any():
            breaks[k] = brk
            break
        chunk *= sizes[k]
        _fold(lo_terms, ro_terms, sizes, k)
    for k in range(len(order)):
        if sizes[k] > 1 and k not in breaks:
            breaks[k] = _level_breaks(lo_terms, ro_terms, sizes, k, chunk)

    lo, ro = _grid(lo_terms, sizes), _grid(ro_terms, sizes)
    n = lo.size
    if not padded:
        merges = sum(_count_merges(brk, sizes, k) for k, brk in breaks.items())
        if merges == 0:  # no step of any level merges: every chunk is a descriptor
            return Descriptors(lo, ro, np.full(n, chunk, dtype=np.int64))
        if merges <= n // 8:  # a few: list them instead of masking the grid
            return _drop(lo, ro, _merge_positions(breaks, sizes), None, chunk)
    else:
        merges = sum(_count_merges(brk, sizes, k) for k, brk in breaks.items())
        valid_subs = int(np.count_nonzero(valid)) - (n_big - 1) * n_sub
        if merges <= n // 8:
            return _padded(lo, ro, breaks, sizes, pos["big"], pos["sub"], valid_subs, chunk)
    starts_mask = np.empty(sizes, dtype=bool)
    starts_mask.reshape(-1)[0] = True
    for k, brk in breaks.items():  # level k: index >= 1 on axis k, 0 on every axis inside it
        tail = (slice(0, 1),) * (len(order) - k - 1)
        starts_mask[(slice(None),) * k + (slice(1, None),) + tail] = brk
    starts_mask = starts_mask.reshape(-1)
    if not padded:
        starts = np.flatnonzero(starts_mask)
        return Descriptors(lo[starts], ro[starts], _run_nbytes(starts, n, chunk))
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
    return Descriptors(lo[at], ro[at], _run_nbytes(starts, kept.size, chunk))

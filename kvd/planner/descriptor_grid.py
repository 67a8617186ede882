"""The chunk grid behind build_read_descriptors: offsets per axis, their sums, merges.

A request's chunks form a grid of up to six axes (kvd.planner.descriptors._AXIS_ORDER);
the offset of a chunk on one side is a sum of per-axis terms. Which neighbours merge
(contiguous on both sides) depends only on the axis that stepped, so merges are decided
per axis on arrays the size of that axis, and the grid of offsets is written once. These
functions return plain (local offsets, remote offsets, sizes) arrays; descriptors.py
wraps them. Kept apart so that the read planning stays readable on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

# (local offsets, remote offsets, sizes in bytes): one array each, one entry per range
Ranges = tuple[np.ndarray, np.ndarray, np.ndarray]


def merge_chunks(lo: np.ndarray, ro: np.ndarray, chunk_nbytes: int) -> Ranges:
    """Collapse runs of equal-size chunks that are contiguous on both sides."""
    if lo.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    starts = np.empty(lo.size, dtype=bool)
    starts[0] = True
    np.not_equal(lo[1:] - lo[:-1], chunk_nbytes, out=starts[1:])
    starts[1:] |= ro[1:] - ro[:-1] != chunk_nbytes
    at = np.flatnonzero(starts)
    return lo[at], ro[at], run_nbytes(at, lo.size, chunk_nbytes)


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


def level_breaks(lo_terms: list[np.ndarray], ro_terms: list[np.ndarray], sizes: list[int],
                  k: int, chunk: int) -> np.ndarray:
    """True where a chunk of level k does not continue its predecessor on some side."""
    brk = np.asarray((_level_delta(lo_terms, sizes, k) != chunk)
                     | (_level_delta(ro_terms, sizes, k) != chunk))
    return brk.reshape((1,) * len(sizes)) if brk.ndim == 0 else brk


def count_merges(brk: np.ndarray, sizes: list[int], k: int) -> int:
    """How many chunks of level k continue their predecessor (brk broadcasts over the
    axes where it has size 1)."""
    mult = 1
    for d in range(k + 1):
        if brk.shape[d] == 1:
            mult *= sizes[d] - 1 if d == k else sizes[d]
    return (brk.size - int(np.count_nonzero(brk))) * mult


def merge_positions(breaks: dict[int, np.ndarray], sizes: list[int]) -> np.ndarray:
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


def drop_merged(lo: np.ndarray, ro: np.ndarray, dropped: np.ndarray, merged: np.ndarray | None,
          chunk: int) -> Ranges:
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
    return lo, ro, nbytes


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


def close_padding(lo: np.ndarray, ro: np.ndarray, breaks: dict[int, np.ndarray], sizes: list[int],
            big: int, sub: int, valid_subs: int, chunk: int) -> Ranges:
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
    merged = merge_positions(breaks, sizes)
    stale = np.concatenate((pad, after))
    merged = merged[~np.isin(merged, stale, assume_unique=False)]
    dropped = np.concatenate((pad, merged, joins))
    flags = np.zeros(dropped.size, dtype=bool)
    flags[pad.size:] = True
    order = np.argsort(dropped, kind="stable")
    return drop_merged(lo, ro, dropped[order], flags[order], chunk)


def fold_axis(lo_terms: list[np.ndarray], ro_terms: list[np.ndarray], sizes: list[int], k: int
          ) -> None:
    """Axis k's lines become single chunks: keep each term's index 0 along k (in place)."""
    cut = (slice(None),) * k + (slice(0, 1),)
    for terms in (lo_terms, ro_terms):
        terms[:] = [t[cut] if t.shape[k] > 1 else t for t in terms]
    sizes[k] = 1


SMALL_GRID = 1 << 14  # chunks up to which build_read_descriptors merges the flat grid
_SHORT = 16  # a last axis shorter than this makes numpy's broadcast loop slow
_TILE = 1 << 18  # chunks per row tile in _outer_sum's short-axis path (2 MiB of int64)
_LONG_INNER = 32  # an inner loop at least this long runs fastest with ufunc buffering off


@contextlib.contextmanager
def _unbuffered(inner: int) -> Iterator[None]:
    """Ufunc buffering off (numpy's smallest buffer) while the inner loop is long.

    With the default 8192-element buffer, an iteration whose inner loop is shorter than
    the buffer (a 1280-long row of a broadcast outer sum) is copied through the buffer
    across rows and back: measured 4.3 ms for 5M int64 sums into warm memory against
    1.7 ms unbuffered. Below ~32 elements per inner loop buffering wins, so it is kept.
    np.setbufsize is per thread (a context variable since numpy 2), restored on exit.
    """
    if inner < _LONG_INNER:
        yield
        return
    old = np.setbufsize(16)
    try:
        yield
    finally:
        np.setbufsize(old)


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
                with _unbuffered(b.size):
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
        with _unbuffered(shape[-1]):
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

    with _unbuffered(out.size // shape[0] // shape[-1]):  # the axes between: one loop
        for r0 in range(0, shape[0], rows):
            tile = out[r0:r0 + rows]
            for s in range(shape[-1]):
                np.add(at(acc, r0, s), at(big, r0, s), out=tile[..., s])
    return out


def grid(terms: list[np.ndarray], sizes: list[int]) -> np.ndarray:
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


def run_nbytes(starts: np.ndarray, n: int, chunk: int) -> np.ndarray:
    """Bytes of each run of chunks starting at `starts` (sorted, starts[0] == 0) out of n.

    By hand: np.diff(starts, append=n) costs ~10x more (it concatenates first).
    """
    out = np.empty(starts.size, dtype=np.int64)
    np.subtract(starts[1:], starts[:-1], out=out[:-1])
    out[-1] = n - starts[-1]
    out *= chunk
    return out

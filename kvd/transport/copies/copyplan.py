"""How a local copy is cut up before any byte moves (pure: numpy only).

A local copy is a list of descriptors ``dst[i] <- src[i]`` of ``nbytes[i]`` bytes, all
addresses in one process (both pools mapped by the daemon). `plan_copy` turns it into
the work the copy threads do:

1. validate (equal lengths, sizes > 0, no two destination ranges overlapping: two
   threads writing one byte would make the result depend on timing);
2. merge descriptors adjacent on both sides (consecutive blocks of a pool become one
   range: fewer calls, longer sequential copies);
3. cut the merged ranges into ``parts`` of equal bytes, splitting a range where a cut
   falls inside it, so each thread copies the same number of bytes whatever the block
   sizes are (a 2 MiB block and a 128 KiB head slice weigh what they carry);
4. cut any piece longer than ``max_piece_nbytes``, so that a copy being abandoned stops
   within one piece's time.

`CopyPlan` is also the CUDA copier's plan: its ``parts`` are what one stream issues.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Copies are cut at multiples of this where a cut falls inside a range, so pieces stay
# aligned for vectorised copies (a cut never lands mid-cache-line).
CUT_ALIGN = 4096
# The longest single copy call: bounds how long an abandoned copy keeps writing.
MAX_PIECE_NBYTES = 8 << 20
# A part below this is not worth a thread: the plan uses fewer parts.
MIN_PART_NBYTES = 1 << 20
MAX_DESCRIPTORS = 1 << 24


@dataclass(frozen=True)
class CopyPart:
    """One thread's (or stream's) share: parallel int64 arrays, one row per copy call."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())

    def __len__(self) -> int:
        return len(self.nbytes)


@dataclass(frozen=True)
class CopyPlan:
    """``parts``: equal shares of bytes, in address order of the merged ranges;
    ``descriptors``: as posted; ``merged``: ranges after merging adjacent ones."""

    parts: tuple[CopyPart, ...]
    descriptors: int
    merged: int
    total: int


def as_descriptors(dst_addrs, src_addrs, nbytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 copies of the three arrays, validated (ValueError says what is wrong)."""
    arrays = [np.asarray(a).reshape(-1) for a in (dst_addrs, src_addrs, nbytes)]
    if len({len(a) for a in arrays}) != 1:
        raise ValueError(f"copy: {len(arrays[0])} destination addresses, {len(arrays[1])} "
                         f"source addresses and {len(arrays[2])} sizes")
    n = len(arrays[0])
    if n == 0:
        raise ValueError("copy: no descriptors")
    if n > MAX_DESCRIPTORS:
        raise ValueError(f"copy: {n} descriptors, at most {MAX_DESCRIPTORS}")
    for name, a in zip(("destination addresses", "source addresses", "sizes"), arrays,
                       strict=True):
        if a.dtype.kind not in "iu":
            raise ValueError(f"copy: {name} must be integers, got {a.dtype}")
        if a.dtype == np.uint64 and (a >= 2**63).any():
            raise ValueError(f"copy: {name} above 2**63")
    dst, src, size = (a.astype(np.int64) for a in arrays)
    if (size <= 0).any():
        raise ValueError("copy: every size must be > 0")
    if (dst < 0).any() or (src < 0).any():
        raise ValueError("copy: negative address")
    order = np.argsort(dst, kind="stable")
    ends = dst[order] + size[order]
    if (ends[:-1] > dst[order][1:]).any():
        raise ValueError("copy: destination ranges overlap")
    return dst, src, size


# Up to this many descriptors, `small_copy` validates with plain Python (a few µs):
# numpy's per-call overhead would be most of a one-block copy's latency.
SMALL_DESCRIPTORS = 8


def _ints(values) -> list | None:
    """``values`` as a list (a numpy integer array in one call), or None if any is not an
    integer."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.tolist()
    out = list(values)
    return out if all(isinstance(v, (int, np.integer)) for v in out) else None


def small_copy(dst_addrs, src_addrs, nbytes) -> list[tuple[int, int, int]] | None:
    """A short copy as validated (dst, src, nbytes) tuples, the same checks as
    `as_descriptors`; None when it has more than `SMALL_DESCRIPTORS` descriptors."""
    n = len(nbytes)
    if n > SMALL_DESCRIPTORS or n == 0:
        return None
    if len(dst_addrs) != n or len(src_addrs) != n:
        raise ValueError(f"copy: {len(dst_addrs)} destination addresses, {len(src_addrs)} "
                         f"source addresses and {n} sizes")
    dsts, srcs, sizes = _ints(dst_addrs), _ints(src_addrs), _ints(nbytes)
    if dsts is None or srcs is None or sizes is None:
        raise ValueError("copy: addresses and sizes must be integers")
    rows = list(zip(map(int, dsts), map(int, srcs), map(int, sizes), strict=True))
    if min(sizes) <= 0:
        raise ValueError("copy: every size must be > 0")
    if min(dsts) < 0 or min(srcs) < 0:
        raise ValueError("copy: negative address")
    if max(dsts) >= 2**63 or max(srcs) >= 2**63:
        raise ValueError("copy: address above 2**63")
    if n > 1:
        spans = sorted((d, d + k) for d, _, k in rows)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            if end > start:
                raise ValueError("copy: destination ranges overlap")
    return rows


def merge_adjacent(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive descriptors adjacent in memory on both sides, as one range each."""
    if len(nbytes) <= 1:
        return dst, src, nbytes
    joined = (dst[1:] == dst[:-1] + nbytes[:-1]) & (src[1:] == src[:-1] + nbytes[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~joined) + 1))
    return dst[starts], src[starts], np.add.reduceat(nbytes, starts)


def _cut_at(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, cuts: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split ranges so that every byte offset in ``cuts`` (ascending, within (0, total))
    falls between two ranges; returns the new arrays and, per cut, the range index it
    now falls before."""
    offsets = np.cumsum(nbytes) - nbytes  # start offset of each range in the copy
    inside = np.searchsorted(offsets, cuts, side="right") - 1  # range containing each cut
    splits = cuts[cuts != offsets[inside]]  # cuts that fall strictly inside a range
    if len(splits):
        # New range starts: the old ones plus every inside cut, as byte offsets.
        new_offsets = np.union1d(offsets, splits)
        owner = np.searchsorted(offsets, new_offsets, side="right") - 1
        shift = new_offsets - offsets[owner]
        ends = np.append(new_offsets[1:], offsets[-1] + nbytes[-1])
        dst, src = dst[owner] + shift, src[owner] + shift
        nbytes = ends - new_offsets
        offsets = new_offsets
    return dst, src, nbytes, np.searchsorted(offsets, cuts)


def plan_copy(dst_addrs, src_addrs, nbytes, parts: int = 1,
              min_part_nbytes: int = MIN_PART_NBYTES,
              max_piece_nbytes: int = MAX_PIECE_NBYTES,
              align: int = CUT_ALIGN) -> CopyPlan:
    """The copy as ``parts`` shares of equal bytes (fewer when it is small).

    Each share differs from ``total / parts`` by less than ``align`` bytes; every byte
    of every descriptor is in exactly one piece, with the same offset on both sides.
    Raises ValueError for malformed descriptors or overlapping destinations.
    """
    if parts < 1 or min_part_nbytes < 1 or max_piece_nbytes < 1 or align < 1:
        raise ValueError("plan_copy: parts, min_part_nbytes, max_piece_nbytes and align "
                         "must be >= 1")
    dst, src, size = as_descriptors(dst_addrs, src_addrs, nbytes)
    posted = len(size)
    dst, src, size = merge_adjacent(dst, src, size)
    merged = len(size)
    total = int(size.sum())
    parts = max(1, min(parts, total // min_part_nbytes))
    # Where shares end, then every max_piece_nbytes inside a range (rounded to align).
    cuts = np.array([(total * p // parts) // align * align for p in range(1, parts)],
                    dtype=np.int64)
    cuts = np.unique(cuts[(cuts > 0) & (cuts < total)])
    dst, src, size, at = _cut_at(dst, src, size, cuts)
    bounds = np.concatenate(([0], at, [len(size)])) if len(cuts) else np.array([0, len(size)])
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out.append(_pieces(dst[lo:hi], src[lo:hi], size[lo:hi], max_piece_nbytes))
    return CopyPlan(parts=tuple(out), descriptors=posted, merged=merged, total=total)


def _pieces(dst: np.ndarray, src: np.ndarray, size: np.ndarray, max_piece: int) -> CopyPart:
    """Ranges longer than ``max_piece`` as several consecutive pieces."""
    count = (size + max_piece - 1) // max_piece
    if (count <= 1).all():
        return CopyPart(dst, src, size)
    rows = np.repeat(np.arange(len(size)), count)
    k = np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    shift = k * max_piece
    return CopyPart(dst[rows] + shift, src[rows] + shift,
                    np.minimum(size[rows] - shift, max_piece))

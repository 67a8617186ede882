"""Where a READ is cut into parts for several posting workers (pure: numpy only).

By bytes, not by descriptors: a READ is a list of byte ranges (local and remote, the
same length each), and a part is a sub-range of that list, so a cut may fall inside a
descriptor: both sides of it are byte ranges, cut at the same offset. That is what
spreads a contiguous pull (one descriptor once the planner merged its blocks) over
every posting worker and rail.

A cut moves to the nearest boundary between merged runs (descriptors adjacent in
memory on both sides are one descriptor once merged) when one lies within ``slack`` of
a part's bytes of the ideal cut: cutting there costs no extra descriptor. Otherwise it
falls inside a descriptor, at an offset that keeps both sides aligned to the READ's
grain (the gcd of its sizes and addresses, at most ``MAX_CUT_GRAIN``). Every cut stays
within ``(part - min_part_nbytes) / 2`` of the ideal, so no part is smaller than
``min_part_nbytes``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import replace

import numpy as np

from kvd.transport.base import ReadPost

# A cut may move to the nearest run boundary when that costs at most this share of a
# part's bytes: with two parts each holds 50 % +- 3 % of the READ.
RUN_CUT_SLACK = 1 / 16
# Cuts inside a descriptor fall on multiples of the READ's grain up to this (pages and
# huge pages stay whole; a part's start is aligned like the READ's own descriptors).
MAX_CUT_GRAIN = 64 << 10


# READs of at most this many descriptors (a cut contiguous pull: one) are split in plain
# Python: numpy's per-call cost on one-element arrays was about half of a split's
# Python path (loopback, cProfile), and every microsecond here delays the parts' copies.
SMALL_READ_DESCRIPTORS = 16


def _ints(arr: np.ndarray | list[int]) -> list[int]:
    return arr.tolist() if isinstance(arr, np.ndarray) else [int(x) for x in arr]


def cut_grain(local_addrs: np.ndarray, remote_addrs: np.ndarray, nbytes: np.ndarray,
              cap: int = MAX_CUT_GRAIN) -> int:
    """The largest power of two <= ``cap`` dividing every size and address of both sides."""
    g = 0
    for arr in (nbytes, local_addrs, remote_addrs):
        if len(arr) <= SMALL_READ_DESCRIPTORS:
            g = math.gcd(g, *_ints(arr))
        else:
            g = math.gcd(g, int(np.gcd.reduce(np.asarray(arr, dtype=np.int64))))
    if g <= 0:
        return 1
    low = g & -g  # lowest set bit: the power-of-two part of the gcd
    return max(1, min(low, cap))


def split_bytes(local_addrs: np.ndarray, remote_addrs: np.ndarray, nbytes: np.ndarray,
                parts: int, min_part_nbytes: int = 1, slack: float = RUN_CUT_SLACK,
                grain: int | None = None) -> list[int]:
    """Byte positions where a READ is cut into ``parts`` of about equal bytes.

    Returns ``k + 1`` ascending positions from 0 to the READ's total bytes, part ``i``
    being bytes ``[cuts[i], cuts[i+1])`` of the READ's descriptors laid end to end. ``k``
    is ``parts`` lowered so that every part holds at least ``min_part_nbytes`` (1 when
    the whole READ is smaller: it stays whole). Pure: no transport, no clock.
    """
    n = len(nbytes)
    small = n <= SMALL_READ_DESCRIPTORS
    if small:
        sizes: list[int] | np.ndarray = _ints(nbytes)
        total = sum(sizes)
    else:
        sizes = np.asarray(nbytes, dtype=np.int64)
        total = int(sizes.sum())
    min_part = max(1, int(min_part_nbytes))
    parts = max(1, min(int(parts), total // min_part))
    if parts == 1 or n == 0:
        return [0, total]
    if small:
        la, ra = _ints(local_addrs), _ints(remote_addrs)
        ends: list[int] | np.ndarray = list(itertools.accumulate(sizes))
        starts: list[int] | np.ndarray = [e - z for e, z in zip(ends, sizes, strict=True)]
        run_bytes: list[int] | np.ndarray = [
            starts[i] for i in range(1, n)
            if la[i] != la[i - 1] + sizes[i - 1] or ra[i] != ra[i - 1] + sizes[i - 1]]
    else:
        ends = np.cumsum(sizes)
        starts = ends - sizes
        la = np.asarray(local_addrs, dtype=np.int64)
        ra = np.asarray(remote_addrs, dtype=np.int64)
        joined = (la[1:] == la[:-1] + sizes[:-1]) & (ra[1:] == ra[:-1] + sizes[:-1])
        run_bytes = starts[1:][~joined]  # positions between two merged runs
    if grain is None:
        grain = cut_grain(la, ra, sizes)
    step = total // parts  # every ideal part holds step or step + 1 bytes
    tolerance = max(0, min(int(slack * total / parts), (step - min_part) // 2))
    cuts = [0]
    for p in range(1, parts):
        ideal = total * p // parts
        cuts.append(_cut_near(ideal, tolerance, run_bytes, starts, ends, grain))
    cuts.append(total)
    return cuts


def _search(arr: list[int] | np.ndarray, x: int, right: bool = False) -> int:
    """numpy's searchsorted, on a list or an array."""
    if isinstance(arr, list):
        return (bisect.bisect_right if right else bisect.bisect_left)(arr, x)
    return int(np.searchsorted(arr, x, side="right" if right else "left"))


def _cut_near(ideal: int, tolerance: int, run_bytes: list[int] | np.ndarray,
              starts: list[int] | np.ndarray, ends: list[int] | np.ndarray, grain: int) -> int:
    """A run boundary within ``tolerance`` of ``ideal``, else a grain-aligned offset
    inside the descriptor holding ``ideal`` within it, else ``ideal`` itself."""
    if len(run_bytes):
        j = _search(run_bytes, ideal)
        near = [int(run_bytes[i]) for i in (j - 1, j) if 0 <= i < len(run_bytes)]
        best = min(near, key=lambda b: abs(b - ideal))
        if abs(best - ideal) <= tolerance:
            return best
    d = _search(ends, ideal, right=True)  # starts[d] <= ideal < ends[d]
    lo = int(starts[d])
    aligned = lo + (ideal - lo + grain // 2) // grain * grain
    if abs(aligned - ideal) <= tolerance and lo <= aligned <= int(ends[d]):
        return aligned
    return ideal


def part_of(post: ReadPost, lo: int, hi: int) -> ReadPost:
    """Bytes ``[lo, hi)`` of a READ (its descriptors laid end to end) as a READ of its
    own: the descriptors it spans, the first and last trimmed on both sides alike."""
    if len(post.nbytes) <= SMALL_READ_DESCRIPTORS:
        sizes: list[int] | np.ndarray = _ints(post.nbytes)
        ends: list[int] | np.ndarray = list(itertools.accumulate(sizes))
    else:
        sizes = np.asarray(post.nbytes, dtype=np.int64)
        ends = np.cumsum(sizes)
    first = _search(ends, lo, right=True)
    last = _search(ends, hi) + 1  # exclusive
    la = np.array(post.local_addrs[first:last], dtype=np.int64)
    ra = np.array(post.remote_addrs[first:last], dtype=np.int64)
    nb = np.array(sizes[first:last], dtype=np.int64)
    skip = lo - (int(ends[first]) - int(sizes[first]))
    la[0] += skip
    ra[0] += skip
    nb[0] -= skip
    nb[-1] -= int(ends[last - 1]) - hi
    return replace(post, local_addrs=la, remote_addrs=ra, nbytes=nb,
                   local_devs=None if post.local_devs is None
                   else post.local_devs[first:last],
                   remote_devs=None if post.remote_devs is None
                   else post.remote_devs[first:last])

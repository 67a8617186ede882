"""Where a READ is cut into parts for several posting workers (pure: numpy only).

By bytes, descriptors whole, and between merged runs where one lies near the ideal
cut: a run of descriptors adjacent in memory on both sides is one descriptor once
NIXL merges it, and cutting it costs a descriptor per part for nothing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvd.transport.base import ReadPost

# A cut may move to the nearest boundary between merged runs when that costs at most
# this share of a part's bytes; otherwise it falls between two descriptors of one run.
RUN_CUT_SLACK = 0.125


def split_points(local_addrs: np.ndarray, remote_addrs: np.ndarray, nbytes: np.ndarray,
                 parts: int, slack: float = RUN_CUT_SLACK) -> list[int]:
    """Descriptor indices where a READ is cut into ``parts`` of about equal bytes.

    Returns ``parts + 1`` ascending indices from 0 to ``len(nbytes)``, distinct, so
    part ``i`` is descriptors ``[cuts[i], cuts[i+1])`` (fewer parts when there are
    fewer descriptors). Descriptors are never cut. A run of descriptors adjacent in
    memory on both sides (one descriptor once NIXL merges it) is cut only when no run
    boundary lies within ``slack`` of a part's bytes of the ideal cut: a READ that is
    one contiguous run (a whole pool) is still split, a fragmented one only between
    runs. Pure: no transport, no clock.
    """
    n = len(nbytes)
    parts = max(1, min(parts, n))
    if parts == 1:
        return [0, n]
    sizes = np.asarray(nbytes, dtype=np.int64)
    ends = np.cumsum(sizes)  # ends[i]: bytes of descriptors [0, i]
    total = int(ends[-1])
    la = np.asarray(local_addrs, dtype=np.int64)
    ra = np.asarray(remote_addrs, dtype=np.int64)
    joined = (la[1:] == la[:-1] + sizes[:-1]) & (ra[1:] == ra[:-1] + sizes[:-1])
    # Cut k (1..n-1) falls before descriptor k; bytes before it: ends[k-1].
    run_cuts = np.flatnonzero(~joined) + 1
    run_bytes = ends[run_cuts - 1]
    tolerance = slack * total / parts
    cuts = [0]
    for p in range(1, parts):
        ideal = total * p / parts
        cut = 0
        if len(run_cuts):
            j = int(np.searchsorted(run_bytes, ideal))
            near = [i for i in (j - 1, j) if 0 <= i < len(run_cuts)]
            best = min(near, key=lambda i: abs(run_bytes[i] - ideal))
            if abs(run_bytes[best] - ideal) <= tolerance:
                cut = int(run_cuts[best])
        if not cut:
            k = int(np.searchsorted(ends, ideal))  # first descriptor ending at/after ideal
            below = k if k >= 1 else 1  # cut before descriptor k: bytes ends[k-1]
            above = k + 1
            cut = min((c for c in (below, above) if 1 <= c <= n - 1),
                      key=lambda c: abs(ends[c - 1] - ideal))
        cut = min(max(cut, cuts[-1] + 1), n - (parts - p))
        cuts.append(cut)
    cuts.append(n)
    return cuts


def part_of(post: ReadPost, lo: int, hi: int) -> ReadPost:
    return replace(post, local_addrs=post.local_addrs[lo:hi],
                   remote_addrs=post.remote_addrs[lo:hi], nbytes=post.nbytes[lo:hi],
                   local_devs=None if post.local_devs is None else post.local_devs[lo:hi],
                   remote_devs=None if post.remote_devs is None else post.remote_devs[lo:hi])

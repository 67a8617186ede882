"""Posting READs through prepared descriptor lists: pools cut into chunk grids.

NIXL keeps a strided row compressed (measured: a 4 GiB pool as 1,048,576 4 KiB
descriptors prepares in <0.1 ms and costs no memory), so a whole pool is one row
of ``chunk``-byte descriptors, and a READ is two int32 index arrays into such
lists. NIXL then merges consecutive indices adjacent on both sides: consecutive
blocks become one descriptor, which fresh lists (``post_read``) never do.

`PoolGrid` is the arithmetic (pools -> rows; addresses -> indices). `PreppedPoster`
is what the daemon's NIXL thread calls instead of ``transport.post_read``: given a
`ReadPost` that names its pools (``local_pools``, ``remote_pools``), it picks the
chunk of the READ (the gcd of its descriptor sizes and pool offsets), prepares a
local and a remote list for (peer, chunk, pools) the first time and reuses them
after, re-prepares when the transport has released them (memory deregistered, peer
removed), and falls back to ``post_read`` for posts without pools, descriptors
outside them, or a grid too fine to be worth it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvd.transport.base import DescRows, PoolSpan, PreppedRead, ReadPost, Transport

__all__ = ["PoolGrid", "PoolSpan", "PreppedPoster", "common_chunk"]


@dataclass(frozen=True)
class PoolGrid:
    """Pools cut into ``chunk``-byte descriptors, one strided row per pool (by base).

    List index of the chunk at ``addr`` in pool ``p``: ``first[p] + (addr - base[p]) //
    chunk``. A descriptor of ``k * chunk`` bytes is ``k`` consecutive indices.
    """

    pools: tuple[PoolSpan, ...]
    chunk: int
    mem_type: str = "DRAM"
    _bases: np.ndarray = field(init=False, repr=False, compare=False)
    _sizes: np.ndarray = field(init=False, repr=False, compare=False)
    _counts: np.ndarray = field(init=False, repr=False, compare=False)
    _first: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chunk <= 0:
            raise ValueError(f"chunk must be > 0, got {self.chunk}")
        pools = tuple(sorted(self.pools, key=lambda p: p.base))
        if not pools:
            raise ValueError("no pools")
        object.__setattr__(self, "pools", pools)
        counts = np.array([p.nbytes // self.chunk for p in pools], dtype=np.int64)
        object.__setattr__(self, "_bases", np.array([p.base for p in pools], dtype=np.int64))
        object.__setattr__(self, "_sizes", counts * self.chunk)  # whole chunks only
        object.__setattr__(self, "_counts", counts)
        object.__setattr__(self, "_first", np.cumsum(counts) - counts)

    def rows(self) -> DescRows:
        keep = self._counts > 0
        n = int(keep.sum())
        return DescRows(addrs=self._bases[keep], nbytes=np.full(n, self.chunk),
                        strides=np.full(n, self.chunk), counts=self._counts[keep],
                        mem_type=self.mem_type,
                        devs=np.array([p.dev for p in self.pools], dtype=np.int64)[keep])

    def locate(self, addrs: np.ndarray, nbytes: np.ndarray
               ) -> tuple[np.ndarray | int, np.ndarray, np.ndarray] | None:
        """(pool index, byte offset in it, end offset) per descriptor; None when one is
        not inside one pool's whole chunks. One pool (the usual case) needs no search."""
        if len(self._bases) == 1:
            off = addrs - self._bases[0]
            ends = off + nbytes
            if len(off) and (off.min() < 0 or ends.max() > self._sizes[0]):
                return None
            return 0, off, ends
        pool = np.searchsorted(self._bases, addrs, side="right") - 1
        if (pool < 0).any():
            return None
        off = addrs - self._bases[pool]
        ends = off + nbytes
        if (ends > self._sizes[pool]).any():
            return None
        return pool, off, ends

    def fits(self, pool: np.ndarray | int, ends: np.ndarray) -> bool:
        """Whether located descriptors (same bases) end inside this grid's whole chunks."""
        if isinstance(pool, int):
            return not len(ends) or bool(ends.max() <= self._sizes[pool])
        return bool((ends <= self._sizes[pool]).all())

    def indices_at(self, pool: np.ndarray | int, off: np.ndarray, nbytes: np.ndarray
                   ) -> np.ndarray:
        """int32 indices for located descriptors whose offsets and sizes are multiples of
        the chunk (``common_chunk`` guarantees it), expanded to one per chunk."""
        first = self._first[pool] + off // self.chunk
        per = nbytes // self.chunk
        if len(per) == 0 or (per.min() == 1 and per.max() == 1):
            return first.astype(np.int32)
        starts = np.repeat(first, per)
        k = np.arange(len(starts), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
        return (starts + k).astype(np.int32)

    def indices(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray | None:
        """int32 indices of the descriptors, expanded to chunks; None when one is outside
        the pools or not aligned to the chunk."""
        addrs = np.asarray(addrs, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        found = self.locate(addrs, nbytes)
        if found is None:
            return None
        pool, off, _ = found
        if (off % self.chunk).any() or (nbytes % self.chunk).any():
            return None
        return self.indices_at(pool, off, nbytes)


def common_chunk(nbytes: np.ndarray, *offsets: np.ndarray) -> int:
    """Largest chunk every descriptor size and pool offset is a multiple of (their gcd)."""
    g = int(np.gcd.reduce(np.asarray(nbytes, dtype=np.int64)))
    for off in offsets:
        if len(off):
            g = math.gcd(g, int(np.gcd.reduce(np.asarray(off, dtype=np.int64))))
    return g


@dataclass
class _Lists:
    local: int
    remote: int
    local_grid: PoolGrid
    remote_grid: PoolGrid


# (pool index, byte offset in it, end offset) per descriptor: `PoolGrid.locate`
_Located = tuple[np.ndarray | int, np.ndarray, np.ndarray]


class _Found(NamedTuple):
    """A post's lists, with its descriptors located in both sides' pools."""

    lists: _Lists
    local: _Located
    remote: _Located
    nbytes: np.ndarray


# (peer, chunk, remote memory, local memory, local pools, remote pools)
_Key = tuple[str, int, str, str, tuple[PoolSpan, ...], tuple[PoolSpan, ...]]


class PreppedPoster:
    """Posts ReadPosts through prepared lists; one per transport, on its (NIXL) thread.

    Lists are cached per (peer, chunk, memory type, local pools, remote pools): a pull
    between the same two engines reuses them, so only the first pull of a chunk size
    prepares (constant cost: one strided row per pool). ``max_expansion``: a READ whose
    chunk grid needs more than this many indices per descriptor goes through
    ``post_read`` (index arrays would cost more than the validation they save).
    ``max_lists``: list pairs kept, least recently used released first.
    """

    def __init__(self, transport: Transport, max_expansion: int = 8,
                 max_lists: int = 64) -> None:
        self.transport = transport
        self.max_expansion = max_expansion
        self.max_lists = max_lists
        self._lists: OrderedDict[_Key, _Lists] = OrderedDict()
        self.prepped_posts = 0
        self.fresh_posts = 0

    def forget_peer(self, peer: str) -> None:
        """Release every list of a peer (optional: stale ones are re-prepared anyway)."""
        for key in [k for k in self._lists if k[0] == peer]:
            self._drop(key)

    def _drop(self, key: _Key) -> None:
        lists = self._lists.pop(key)
        self.transport.release_prepared(lists.local)
        self.transport.release_prepared(lists.remote)

    def close(self) -> None:
        for key in list(self._lists):
            self._drop(key)

    def lists(self) -> int:
        return len(self._lists)

    def _lists_for(self, key: _Key) -> _Lists:
        lists = self._lists.get(key)
        if lists is not None and self.transport.is_prepared(lists.local) and \
                self.transport.is_prepared(lists.remote):
            self._lists.move_to_end(key)
            return lists
        if lists is not None:  # released under us: memory deregistered or peer reloaded
            self._drop(key)
        peer, chunk, mem_type, local_mem, local_pools, remote_pools = key
        local_grid = PoolGrid(local_pools, chunk, local_mem)
        remote_grid = PoolGrid(remote_pools, chunk, mem_type)
        local = self.transport.prepare_local(local_grid.rows())
        try:
            remote = self.transport.prepare_remote(peer, remote_grid.rows())
        except BaseException:
            self.transport.release_prepared(local)
            raise
        while len(self._lists) >= self.max_lists:
            self._drop(next(iter(self._lists)))
        lists = self._lists[key] = _Lists(local, remote, local_grid, remote_grid)
        return lists

    def post(self, post: ReadPost) -> tuple[int, bool]:
        """Post through prepared lists when it can, else ``post_read``; (xfer id, done).

        Raises TransferError like the transport does.
        """
        prepped = self._prepped(post)
        if prepped is None:
            self.fresh_posts += 1
            return self.transport.post_read(post)
        self.prepped_posts += 1
        return self.transport.post_prepped_read(prepped)

    def prepare(self, post: ReadPost) -> bool:
        """Prepare the lists ``post`` would go through, without posting it: ahead of a
        pair's first READ (a sample of its pulls, kvd.daemon.pull.consumer.warm_pair), so
        that one only picks indices. False: it would not go through prepared lists.

        Raises TransferError like the transport does.
        """
        return self._lists_of(post) is not None

    def _lists_of(self, post: ReadPost) -> _Found | None:
        """The lists a post goes through, prepared now if they are not, with its
        descriptors located in their pools; None: it goes through ``post_read``."""
        if not post.local_pools or not post.remote_pools or len(post.nbytes) == 0:
            return None
        local_pools = tuple(sorted(post.local_pools, key=lambda p: p.base))
        remote_pools = tuple(sorted(post.remote_pools, key=lambda p: p.base))
        nbytes = np.asarray(post.nbytes, dtype=np.int64)
        laddrs = np.asarray(post.local_addrs, dtype=np.int64)
        raddrs = np.asarray(post.remote_addrs, dtype=np.int64)
        # Located on byte grids first: the chunk depends on the offsets.
        local = PoolGrid(local_pools, 1).locate(laddrs, nbytes)
        remote = PoolGrid(remote_pools, 1).locate(raddrs, nbytes)
        if local is None or remote is None:
            return None
        chunk = common_chunk(nbytes, local[1], remote[1])
        if int(nbytes.sum()) // chunk > self.max_expansion * len(nbytes):
            return None
        lists = self._lists_for((post.peer, chunk, post.mem_type,
                                 post.local_mem_type or post.mem_type, local_pools, remote_pools))
        # The chunk grids hold whole chunks only: a pool's tail may lie outside them.
        if not (lists.local_grid.fits(local[0], local[2])
                and lists.remote_grid.fits(remote[0], remote[2])):
            return None
        return _Found(lists, local, remote, nbytes)

    def _prepped(self, post: ReadPost) -> PreppedRead | None:
        found = self._lists_of(post)
        if found is None:
            return None
        lists, local, remote, nbytes = found
        li = lists.local_grid.indices_at(local[0], local[1], nbytes)
        ri = lists.remote_grid.indices_at(remote[0], remote[1], nbytes)
        return PreppedRead(post.peer, lists.local, lists.remote, li, ri, post.notif)

"""Posting READs through prepared descriptor lists: pools cut into chunk grids.

NIXL keeps a strided row compressed (measured: a 4 GiB pool as 1,048,576 4 KiB
descriptors prepares in <0.1 ms and costs no memory), so a whole pool is one row
of ``chunk``-byte descriptors, and a READ is two int32 index arrays into such
lists. NIXL then merges consecutive indices adjacent on both sides: consecutive
blocks become one descriptor, which fresh lists (``post_read``) never do.

`PoolGrid` is the arithmetic (pools -> rows; addresses -> indices). `PreppedPoster`
is what the daemon's NIXL thread calls instead of ``transport.post_read``: it keeps
one local and one remote list per (peer, chunk), picks the chunk of each READ (the
gcd of its descriptor sizes and pool offsets), prepares lists the first time a
chunk is seen, re-prepares when pools change, and falls back to ``post_read`` for
descriptors outside known pools or too finely cut to be worth it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvd.transport.base import DescRows, PreppedRead, ReadPost, Transport


@dataclass(frozen=True)
class PoolSpan:
    """A registered pool: base address, size, device (GPU index; 0 for DRAM)."""

    base: int
    nbytes: int
    dev: int = 0


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


class PreppedPoster:
    """Posts ReadPosts through prepared lists; one instance per transport (NIXL thread).

    ``max_expansion``: a READ whose chunk grid would need more than this many indices
    per descriptor goes through ``post_read`` instead (index arrays would cost more than
    the validation they save). ``max_chunks_per_peer``: lists kept per peer (one pair
    per distinct chunk size in use), oldest released first.
    """

    def __init__(self, transport: Transport, max_expansion: int = 8,
                 max_chunks_per_peer: int = 4) -> None:
        self.transport = transport
        self.max_expansion = max_expansion
        self.max_chunks_per_peer = max_chunks_per_peer
        self._local: tuple[PoolSpan, ...] = ()
        self._remote: dict[str, tuple[PoolSpan, ...]] = {}
        self._lists: dict[tuple[str, int, str], _Lists] = {}  # insertion order = age
        self.prepped_posts = 0
        self.fresh_posts = 0

    def set_local_pools(self, pools: list[PoolSpan]) -> None:
        """This agent's registered pools changed (registration, deregistration)."""
        pools_t = tuple(sorted(pools, key=lambda p: p.base))
        if pools_t != self._local:
            self._local = pools_t
            for key in list(self._lists):
                self._drop(key)

    def set_remote_pools(self, peer: str, pools: list[PoolSpan]) -> None:
        """A peer's pools as its handshake describes them (call again after a reload)."""
        pools_t = tuple(sorted(pools, key=lambda p: p.base))
        if self._remote.get(peer) != pools_t:
            self._remote[peer] = pools_t
            self.forget_peer(peer, keep_pools=True)

    def forget_peer(self, peer: str, keep_pools: bool = False) -> None:
        """Release the peer's lists. Call it before the transport removes or reloads the
        peer (NixlTransport.remove_peer releases them too, leaving stale ids here)."""
        for key in [k for k in self._lists if k[0] == peer]:
            self._drop(key)
        if not keep_pools:
            self._remote.pop(peer, None)

    def _drop(self, key: tuple[str, int, str]) -> None:
        lists = self._lists.pop(key)
        self.transport.release_prepared(lists.local)
        self.transport.release_prepared(lists.remote)

    def close(self) -> None:
        for key in list(self._lists):
            self._drop(key)

    def _lists_for(self, peer: str, chunk: int, mem_type: str) -> _Lists:
        key = (peer, chunk, mem_type)
        lists = self._lists.get(key)
        if lists is not None:
            return lists
        local_grid = PoolGrid(self._local, chunk, mem_type)
        remote_grid = PoolGrid(self._remote[peer], chunk, mem_type)
        local = self.transport.prepare_local(local_grid.rows())
        try:
            remote = self.transport.prepare_remote(peer, remote_grid.rows())
        except BaseException:
            self.transport.release_prepared(local)
            raise
        mine = [k for k in self._lists if k[0] == peer]
        if len(mine) >= self.max_chunks_per_peer:
            self._drop(mine[0])
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

    def _prepped(self, post: ReadPost) -> PreppedRead | None:
        if not self._local or post.peer not in self._remote or len(post.nbytes) == 0:
            return None
        nbytes = np.asarray(post.nbytes, dtype=np.int64)
        laddrs = np.asarray(post.local_addrs, dtype=np.int64)
        raddrs = np.asarray(post.remote_addrs, dtype=np.int64)
        # Located on byte grids first: the chunk depends on the offsets.
        local = PoolGrid(self._local, 1).locate(laddrs, nbytes)
        remote = PoolGrid(self._remote[post.peer], 1).locate(raddrs, nbytes)
        if local is None or remote is None:
            return None
        chunk = common_chunk(nbytes, local[1], remote[1])
        if int(nbytes.sum()) // chunk > self.max_expansion * len(nbytes):
            return None
        lists = self._lists_for(post.peer, chunk, post.mem_type)
        # The chunk grids hold whole chunks only: a pool's tail may lie outside them.
        if not (lists.local_grid.fits(local[0], local[2])
                and lists.remote_grid.fits(remote[0], remote[2])):
            return None
        li = lists.local_grid.indices_at(local[0], local[1], nbytes)
        ri = lists.remote_grid.indices_at(remote[0], remote[1], nbytes)
        return PreppedRead(post.peer, lists.local, lists.remote, li, ri, post.notif)

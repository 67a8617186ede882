"""A pull as block ids over a table prepared once per pool pair (pure: numpy only).

Most pulls are a few strided patterns: for every plan read, the descriptors of block
pair (0, 0) shifted by a block stride on each side (kvd.planner.assembly's one-block
templates). `BlockTable` holds those rows for every read of a producer (absolute
addresses at block pair (0, 0), each row's block stride on both sides, its devices);
`BlockCopy` is one pull over it: a destination and a source block id per block pair.
Row ``j`` of block pair ``i`` copies ``nbytes[j]`` from ``src[j] + src_ids[i] *
src_stride[j]`` to ``dst[j] + dst_ids[i] * dst_stride[j]``.

A copier that computes addresses itself (the CUDA copier's block kernel,
kvd.transport.copies.cudacopy) takes this form as is, so the host's work per pull grows with
its blocks, not with how finely each block is cut; any other consumer asks for
`BlockCopy.expand` (the same bytes as descriptor arrays). Like NIXL's prepared lists,
the table is built once and a pull only names indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Up to this many block pairs, ids are checked in plain Python (numpy's per-call cost
# would be most of a one-block pull's check).
SMALL_BLOCKS = 8


@dataclass(frozen=True, eq=False)
class BlockTable:
    """One producer's rows at block pair (0, 0), with their block strides and devices.

    Identity is the table (``eq=False``): a copier prepares it once and keys what it
    prepared by the object. ``dst_blocks`` / ``src_blocks``: the ids every row is valid
    for, [0, n) on each side (the smallest pool among the rows').
    """

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray
    dst_stride: np.ndarray
    src_stride: np.ndarray
    dst_devs: np.ndarray
    src_devs: np.ndarray
    dst_blocks: int
    src_blocks: int

    def __post_init__(self) -> None:
        cols = [np.asarray(a, dtype=np.int64).reshape(-1)
                for a in (self.dst, self.src, self.nbytes, self.dst_stride, self.src_stride)]
        n = len(cols[0])
        devs = [np.broadcast_to(np.asarray(d, dtype=np.int64), (n,)).copy()
                for d in (self.dst_devs, self.src_devs)]
        if n == 0 or any(len(c) != n for c in cols):
            raise ValueError("BlockTable: rows missing or of different lengths")
        if (cols[2] <= 0).any() or (cols[3] < 0).any() or (cols[4] < 0).any():
            raise ValueError("BlockTable: nbytes must be > 0 and strides >= 0")
        if (cols[0] < 0).any() or (cols[1] < 0).any():
            raise ValueError("BlockTable: negative address")
        if self.dst_blocks < 1 or self.src_blocks < 1:
            raise ValueError("BlockTable: each side needs at least one block")
        for name, arr in zip(("dst", "src", "nbytes", "dst_stride", "src_stride",
                              "dst_devs", "src_devs"), cols + devs, strict=True):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "block_nbytes", int(cols[2].sum()))

    block_nbytes: int = field(init=False, default=0)  # bytes of one block pair's rows

    def __len__(self) -> int:
        return len(self.nbytes)


def check_ids(table: BlockTable, dst_ids, src_ids) -> tuple[np.ndarray, np.ndarray]:
    """The pull's ids as int64 arrays, checked: as many on each side (at least one),
    each within its side's blocks, no destination block twice (two writers of one byte).
    Raises ValueError saying what is wrong."""
    n = len(dst_ids)
    if n != len(src_ids):
        raise ValueError(f"copy: {n} destination and {len(src_ids)} source block ids")
    if n == 0:
        raise ValueError("copy: no block ids")
    if n <= SMALL_BLOCKS and not isinstance(dst_ids, np.ndarray):
        if not all(isinstance(x, (int, np.integer)) for x in (*dst_ids, *src_ids)):
            raise ValueError("copy: block ids must be integers")
        d, s = [int(x) for x in dst_ids], [int(x) for x in src_ids]
        lo_d, hi_d, lo_s, hi_s = min(d), max(d), min(s), max(s)
        twice = len(set(d)) != n
        dst, src = np.array(d, dtype=np.int64), np.array(s, dtype=np.int64)
    else:
        dst = np.asarray(dst_ids).reshape(-1)
        src = np.asarray(src_ids).reshape(-1)
        if dst.dtype.kind not in "iu" or src.dtype.kind not in "iu":
            raise ValueError("copy: block ids must be integers")
        dst, src = dst.astype(np.int64, copy=False), src.astype(np.int64, copy=False)
        lo_d, hi_d, lo_s, hi_s = int(dst.min()), int(dst.max()), int(src.min()), int(src.max())
        twice = False
        if lo_d >= 0 and hi_d < table.dst_blocks:
            seen = np.zeros(table.dst_blocks, dtype=bool)
            seen[dst] = True
            twice = int(np.count_nonzero(seen)) != n
    if lo_d < 0 or hi_d >= table.dst_blocks:
        raise ValueError(f"copy: destination block ids outside [0, {table.dst_blocks})")
    if lo_s < 0 or hi_s >= table.src_blocks:
        raise ValueError(f"copy: source block ids outside [0, {table.src_blocks})")
    if twice:
        raise ValueError("copy: a destination block named twice (destination ranges overlap)")
    return dst, src


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """One pull over a `BlockTable`: block pair ``i`` is (``dst_ids[i]``, ``src_ids[i]``).
    The ids are as the pull named them (checked by the copier, `check_ids`)."""

    table: BlockTable
    dst_ids: np.ndarray | tuple[int, ...] | list[int]
    src_ids: np.ndarray | tuple[int, ...] | list[int]

    @property
    def blocks(self) -> int:
        return len(self.dst_ids)

    @property
    def descriptors(self) -> int:
        return self.blocks * len(self.table)

    @property
    def total_nbytes(self) -> int:
        return self.blocks * self.table.block_nbytes

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, nbytes, dst devs, src devs), one row per (block pair, table row),
        block pair by block pair: the descriptors for a copier that needs them."""
        t = self.table
        d = np.asarray(self.dst_ids, dtype=np.int64).reshape(-1, 1)
        s = np.asarray(self.src_ids, dtype=np.int64).reshape(-1, 1)
        n = len(d)
        return ((t.dst + d * t.dst_stride).reshape(-1), (t.src + s * t.src_stride).reshape(-1),
                np.tile(t.nbytes, n), np.tile(t.dst_devs, n), np.tile(t.src_devs, n))

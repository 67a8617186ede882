"""Pull assembly: from a plan, block ids and both sides' pools to descriptor arrays.

The consumer daemon and ``kvd bench`` both call ``assemble_pull``, so the bench
times the product's own descriptors by construction. Pure: no sockets, NIXL or
clocks; addresses are plain integers (a pool's base address plus the byte
offsets ``build_read_descriptors`` computes).

Two steps:

1. ``match_tail``: which remote blocks feed which local ones. Fewer local than
   remote tokens means a prefix-cache hit: only the tail is read. When prefill
   blocks are larger than decode blocks, where that tail starts depends on the
   prompt's token count; without it (``num_tokens = -1``) an ambiguous pull is
   refused, never placed at a guess.
2. ``assemble_pull``: every read of the plan for every local rank, as descriptors
   grouped by the producer (NIXL agent) hosting its remote rank: one READ each.

A one-block pull (the latency-bound case) takes its descriptors from a template
per (read, pair of rank layouts): the descriptors of blocks (0, 0), shifted by
each side's block stride. It is derived from ``build_read_descriptors`` itself
and used only where that shift reproduces it exactly (checked at blocks 1 and
the last ones), so it returns the same descriptors in microseconds.

The same templates, for every read of a producer, make its `BlockTable`
(kvd.planner.blocks): with ``blocks=True`` a pull of equal block sizes on both sides
comes back as block ids over that table (`ProducerReads.blocks`), built once per
(engine, peer engine); its descriptor columns are then computed only if something asks
for them (by ``assemble_pull``, so they are what they always were).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import BlockIdError, LayoutError
from kvd.planner.blocks import BlockCopy, BlockTable
from kvd.planner.descriptors import Descriptors, build_read_descriptors
from kvd.planner.layout import CacheLayout
from kvd.planner.plan import RankId, Read, TransferPlan

SMALL_IDS = 8  # id lists up to this long are checked in Python, not numpy
# A pull of at most this many descriptors per producer keeps them as tuples of ints:
# through `kvd serve`, each numpy call of a one-block pull costs 2-5 us (a cold call
# path, not the arithmetic), and a dozen of them were a quarter of its control work.
SMALL_DESCRIPTORS = 8

# A column of descriptors: an int64 array, or (at most SMALL_DESCRIPTORS) a tuple of ints.
Column = np.ndarray | tuple[int, ...]


@dataclass(frozen=True)
class RankPool:
    """One rank's pool as the assembly sees it."""

    rank: RankId
    cache: CacheLayout
    first_layer: int  # global index of the rank's first layer (its PP stage)
    base_addr: int
    device_id: int = 0  # GPU index of VRAM pools (0 for DRAM)
    owner: str = ""  # remote side: the producer (NIXL agent) hosting it


@dataclass
class ProducerReads:
    """Everything one pull reads from one producer: one NIXL READ plus its notice."""

    owner: str
    reads: int = 0  # planner reads served (what the producer's notice counts)
    _parts: list[tuple[np.ndarray, ...]] = field(default_factory=list, repr=False)
    # kept as parts are added: a one-block pull asks for both more than once
    descriptors: int = 0
    total_nbytes: int = 0
    # The same reads as block ids over the producer's table (PreparedPull.assemble with
    # blocks=True); the columns are then built on first use, by ``_fill``.
    blocks: BlockCopy | None = None
    _fill: Callable[[], None] | None = field(default=None, repr=False)

    def add(self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, local_dev: int,
            remote_dev: int) -> None:
        n = len(nbytes)
        self.add_rows(local, remote, nbytes, np.full(n, local_dev, dtype=np.int64),
                      np.full(n, remote_dev, dtype=np.int64))

    def add_rows(self, local: Column, remote: Column, nbytes: Column, local_devs: Column,
                 remote_devs: Column, total_nbytes: int | None = None) -> None:
        """`add`, with the device columns ready (read-only arrays may be shared; or all
        five as tuples of ints), and the sum of ``nbytes`` when the caller knows it."""
        self._parts.append((local, remote, nbytes, local_devs, remote_devs))
        self.descriptors += len(nbytes)
        if total_nbytes is None:
            total_nbytes = (int(nbytes.sum()) if isinstance(nbytes, np.ndarray)
                            else sum(nbytes))
        self.total_nbytes += total_nbytes

    def _column(self, i: int) -> Column:
        """Column ``i`` of every part: tuples while they are few and all tuples (no
        numpy on a one-block pull's path), else one int64 array. A block-form group
        whose columns are not built yet answers with a `DeferredColumn`."""
        if self._fill is not None:
            return DeferredColumn(self, i)
        parts = self._parts
        if not parts:
            return np.zeros(0, dtype=np.int64)
        if self.descriptors <= SMALL_DESCRIPTORS and all(
                type(p[i]) is tuple for p in parts):
            if len(parts) == 1:
                return parts[0][i]
            return tuple(x for p in parts for x in p[i])
        if len(parts) == 1:
            return np.asarray(parts[0][i]).astype(np.int64, copy=False)
        return np.concatenate([np.asarray(p[i], dtype=np.int64) for p in parts])

    def built_column(self, i: int) -> Column:
        """Column ``i``, building the columns first if they are deferred."""
        if self._fill is not None:
            self._fill()  # clears every group's _fill once built
        return self._column(i)

    @property
    def local_addrs(self) -> Column:
        return self._column(0)

    @property
    def remote_addrs(self) -> Column:
        return self._column(1)

    @property
    def nbytes(self) -> Column:
        return self._column(2)

    @property
    def local_devs(self) -> Column:
        return self._column(3)

    @property
    def remote_devs(self) -> Column:
        return self._column(4)


class DeferredColumn:
    """A column of a block-form `ProducerReads` not built yet: built (for every column
    of the pull at once) when numpy converts it or its length is asked. Only what needs
    descriptors pays for them; a copier taking `ProducerReads.blocks` never does."""

    __slots__ = ("_group", "_i")

    def __init__(self, group: ProducerReads, i: int) -> None:
        self._group, self._i = group, i

    def built(self) -> Column:
        return self._group.built_column(self._i)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.built(), dtype=dtype)

    def __len__(self) -> int:
        return len(self.built())

    def __iter__(self):
        return iter(self.built())

    def __getitem__(self, key):
        return np.asarray(self.built())[key]

    def tolist(self) -> list[int]:
        return np.asarray(self.built()).tolist()


def _ids(values: Sequence[int] | np.ndarray, what: str) -> list[int] | np.ndarray:
    """Checked block ids: a small list stays a list (no numpy on a one-block pull's
    path), anything else becomes a flat int64 array."""
    if isinstance(values, list) and len(values) <= SMALL_IDS:
        if values and min(values) < 0:
            raise BlockIdError(f"{what} block ids {[v for v in values if v < 0][:8]} are "
                               "negative")
        return values
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise BlockIdError(f"{what} block ids {arr[arr < 0][:8].tolist()} are negative")
    return arr


def match_tail(local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray,
               local_block_tokens: int, remote_block_tokens: int, num_tokens: int = -1
               ) -> tuple[list[int] | np.ndarray, list[int] | np.ndarray]:
    """(local ids, the remote ids that fill them): exact, or LayoutError.

    ``num_tokens`` (the prompt's token count, -1 unknown) is checked against the remote
    blocks when given. Without it a pull is ambiguous, and refused, only when prefill
    blocks are larger than decode blocks and the local blocks do not cover every remote
    block exactly (a prefix hit, or a partial last prefill block).
    Lists of up to ``SMALL_IDS`` ids come back as lists, the rest as int64 arrays.
    """
    local = _ids(local_ids, "local")
    remote = _ids(remote_ids, "remote")
    if len(local) == 0:
        return local, remote[:0]  # notify only
    if len(remote) == 0:
        raise LayoutError("pull names local blocks but no remote blocks")
    bs_l, bs_r = local_block_tokens, remote_block_tokens
    if max(bs_l, bs_r) % min(bs_l, bs_r):
        raise LayoutError(f"block sizes {bs_l} (decode) and {bs_r} (prefill) do not divide")
    if num_tokens >= 0 and -(-num_tokens // bs_r) != len(remote):
        raise LayoutError(f"num_tokens {num_tokens} fills {-(-num_tokens // bs_r)} prefill "
                          f"blocks of {bs_r} tokens, but the pull names {len(remote)}")
    if bs_l >= bs_r:  # decode blocks hold m prefill blocks: a hit is whole prefill blocks
        m = bs_l // bs_r
        groups = -(-len(remote) // m)
        skip = groups - len(local)
        if skip < 0:
            raise LayoutError(f"pull names {len(local)} local blocks but the remote request only "
                              f"fills {groups}")
        return local, remote[skip * m:]
    m = bs_r // bs_l  # prefill blocks hold m decode blocks
    if num_tokens < 0:
        if len(local) != len(remote) * m:
            raise LayoutError(
                f"ambiguous pull: {len(local)} decode blocks of {bs_l} tokens from {len(remote)} "
                f"prefill blocks of {bs_r} tokens (prefix hit or partial last block?); pass "
                "num_tokens")
        return local, remote
    skip = -(-num_tokens // bs_l) - len(local)  # decode blocks the engine already holds
    if skip < 0:
        raise LayoutError(f"pull names {len(local)} local blocks but {num_tokens} tokens fill "
                          f"only {-(-num_tokens // bs_l)}")
    first_token = skip * bs_l
    if first_token % bs_r:
        raise LayoutError(
            f"prefix hit of {first_token} tokens ends inside a prefill block of {bs_r} tokens: "
            "a decode block would mix cached and read tokens; recompute that block instead")
    return local, remote[first_token // bs_r:]


@dataclass(frozen=True)
class _BlockTemplate:
    """One block pair's descriptors at blocks (0, 0), and each side's block stride."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: np.ndarray
    local_stride: int
    remote_stride: int
    local_blocks: int
    remote_blocks: int

    def at(self, local_id: int, remote_id: int) -> Descriptors:
        if not (0 <= local_id < self.local_blocks and 0 <= remote_id < self.remote_blocks):
            raise LayoutError(f"block ids ({local_id}, {remote_id}) out of range "
                              f"[0, {self.local_blocks}) / [0, {self.remote_blocks})")
        return Descriptors(self.local + local_id * self.local_stride,
                           self.remote + remote_id * self.remote_stride, self.nbytes)


def _shift(a: np.ndarray, b: np.ndarray) -> int | None:
    """The one offset that turns ``a`` into ``b``, element-wise, or None."""
    if a.shape != b.shape or not a.size:
        return None
    d = b - a
    return int(d[0]) if (d == d[0]).all() else None


@functools.lru_cache(maxsize=1024)
def _block_template(read: Read, local: CacheLayout, local_first: int, remote: CacheLayout,
                    remote_first: int) -> _BlockTemplate | None:
    """The template of one-block pulls for a read between two rank layouts, or None
    where shifting it would not give exactly what ``build_read_descriptors`` gives."""
    if local.num_blocks < 2 or remote.num_blocks < 2:
        return None
    nl, nr = local.num_blocks - 1, remote.num_blocks - 1

    def build(lid: int, rid: int) -> Descriptors:
        return build_read_descriptors(read, local, local_first, remote, remote_first,
                                      np.array([lid], dtype=np.int64),
                                      np.array([rid], dtype=np.int64))

    d0 = build(0, 0)
    if not len(d0):
        return None
    d_local, d_remote, d_last = build(1, 0), build(0, 1), build(nl, nr)
    ls = _shift(d0.local_offsets, d_local.local_offsets)
    rs = _shift(d0.remote_offsets, d_remote.remote_offsets)
    if (ls is None or rs is None
            or not np.array_equal(d0.remote_offsets, d_local.remote_offsets)
            or not np.array_equal(d0.local_offsets, d_remote.local_offsets)
            or not all(np.array_equal(d0.nbytes, d.nbytes) for d in (d_local, d_remote, d_last))
            or not np.array_equal(d0.local_offsets + nl * ls, d_last.local_offsets)
            or not np.array_equal(d0.remote_offsets + nr * rs, d_last.remote_offsets)):
        return None
    for a in (d0.local_offsets, d0.remote_offsets, d0.nbytes):
        a.setflags(write=False)
    return _BlockTemplate(d0.local_offsets, d0.remote_offsets, d0.nbytes, ls, rs,
                          local.num_blocks, remote.num_blocks)


def read_descriptors(read: Read, local: CacheLayout, local_first: int, remote: CacheLayout,
                     remote_first: int, local_ids: np.ndarray, remote_ids: np.ndarray
                     ) -> Descriptors:
    """``build_read_descriptors``, from the block template for a one-block pull."""
    if len(local_ids) == 1 and len(remote_ids) == 1:
        template = _block_template(read, local, local_first, remote, remote_first)
        if template is not None:
            return template.at(int(local_ids[0]), int(remote_ids[0]))
    return build_read_descriptors(read, local, local_first, remote, remote_first, local_ids,
                                  remote_ids)


def assemble_pull(plan: TransferPlan, local_ranks: Iterable[RankPool],
                  remote_ranks: Mapping[RankId, RankPool], local_ids: np.ndarray,
                  remote_ids: np.ndarray, owners: Iterable[str] = ()
                  ) -> dict[str, ProducerReads]:
    """Descriptors of one pull, grouped by producer.

    Every plan read of every local rank counts for its producer, with or without
    descriptors (no local blocks = notify only: the producer still counts the reads to
    release the request). ``owners`` lists producers to report even when no read goes
    to them.
    """
    groups: dict[str, ProducerReads] = {o: ProducerReads(o) for o in owners}
    notify_only = len(local_ids) == 0
    local_ids = np.asarray(local_ids, dtype=np.int64)
    remote_ids = np.asarray(remote_ids, dtype=np.int64)
    for lr in local_ranks:
        for read in plan.reads_for(lr.rank):
            rr = remote_ranks.get(read.remote)
            if rr is None:
                raise LayoutError(f"plan reads remote rank {read.remote.key}, which is not known")
            g = groups.setdefault(rr.owner, ProducerReads(rr.owner))
            g.reads += 1
            if notify_only:
                continue
            d = read_descriptors(read, lr.cache, lr.first_layer, rr.cache, rr.first_layer,
                                 local_ids, remote_ids)
            g.add(d.local_offsets + lr.base_addr, d.remote_offsets + rr.base_addr, d.nbytes,
                  lr.device_id, rr.device_id)
    return groups


@dataclass(frozen=True)
class _ReadRows:
    """One plan read of one local rank, ready for one-block pulls: its template's
    descriptors at blocks (0, 0) with both pools' base addresses already added."""

    owner: str
    local: np.ndarray
    remote: np.ndarray
    nbytes: np.ndarray
    local_devs: np.ndarray
    remote_devs: np.ndarray
    template: _BlockTemplate
    total_nbytes: int
    # (local, remote, nbytes, local devs, remote devs) as tuples of ints when the read
    # has at most SMALL_DESCRIPTORS descriptors (else None)
    small: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class PreparedPull:
    """`assemble_pull` with its inputs bound once per (engine, peer engine): what a
    small pull would otherwise rebuild every time (most of a 1-block pull's
    control-path cost). A one-block pull takes
    its rows from the ready templates (a shift per read, no planning, no lookups);
    any other pull, or one whose reads have no template, goes through
    `assemble_pull` itself. Same descriptors either way (tests/planner/test_assembly.py)."""

    plan: TransferPlan
    local_ranks: tuple[RankPool, ...]
    remote_ranks: Mapping[RankId, RankPool]
    owners: tuple[str, ...]
    rows: tuple[_ReadRows, ...] | None  # None: some read has no one-block template
    local_blocks: int = 0  # block ids every row's template covers: [0, n) on each side
    remote_blocks: int = 0
    # owner -> its rows as one BlockTable; None where a pull is not one block id per
    # block on each side (block sizes differ, or some read has no template)
    tables: Mapping[str, BlockTable] | None = None

    def assemble(self, local_ids: Sequence[int] | np.ndarray,
                 remote_ids: Sequence[int] | np.ndarray, blocks: bool = False
                 ) -> dict[str, ProducerReads]:
        """The pull's reads by producer. ``blocks``: also as block ids over each
        producer's table where the pull allows it (`ProducerReads.blocks`)."""
        if blocks and self.tables is not None and 1 < len(local_ids) == len(remote_ids):
            groups = self._assemble_blocks(local_ids, remote_ids)
            if groups is not None:
                return groups
        if self.rows is None or len(local_ids) != 1 or len(remote_ids) != 1:
            return assemble_pull(self.plan, self.local_ranks, self.remote_ranks, local_ids,
                                 remote_ids, self.owners)
        lid, rid = int(local_ids[0]), int(remote_ids[0])
        if not (0 <= lid < self.local_blocks and 0 <= rid < self.remote_blocks):
            # out of some pool: assemble_pull raises what it always raises
            return assemble_pull(self.plan, self.local_ranks, self.remote_ranks, local_ids,
                                 remote_ids, self.owners)
        groups = self._one_block(lid, rid)
        if blocks and self.tables is not None:
            for owner, table in self.tables.items():
                groups[owner].blocks = BlockCopy(table, (lid,), (rid,))
        return groups

    def _assemble_blocks(self, local_ids: Sequence[int] | np.ndarray,
                         remote_ids: Sequence[int] | np.ndarray
                         ) -> dict[str, ProducerReads] | None:
        """Every producer's reads as block ids over its table, the columns deferred to
        ``assemble_pull``; None (assemble as usual) for ids outside some pool, which
        ``assemble_pull`` refuses as it always does."""
        lids = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        rids = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
        if not (int(lids.min()) >= 0 and int(lids.max()) < self.local_blocks
                and int(rids.min()) >= 0 and int(rids.max()) < self.remote_blocks):
            return None
        assert self.rows is not None and self.tables is not None
        groups: dict[str, ProducerReads] = {o: ProducerReads(o) for o in self.owners}
        for r in self.rows:
            g = groups.get(r.owner)
            if g is None:
                g = groups[r.owner] = ProducerReads(r.owner)
            g.reads += 1

        def fill() -> None:  # the descriptors, as assemble_pull builds them
            full = assemble_pull(self.plan, self.local_ranks, self.remote_ranks, lids, rids,
                                 self.owners)
            for owner, g in groups.items():
                f = full[owner]
                g._parts, g.descriptors = f._parts, f.descriptors
                g._fill = None

        for owner, table in self.tables.items():
            g = groups[owner]
            g.blocks = BlockCopy(table, lids, rids)
            g.descriptors, g.total_nbytes = g.blocks.descriptors, g.blocks.total_nbytes
            g._fill = fill
        return groups

    def _one_block(self, lid: int, rid: int) -> dict[str, ProducerReads]:
        groups: dict[str, ProducerReads] = {o: ProducerReads(o) for o in self.owners}
        for r in self.rows:
            t = r.template
            g = groups.get(r.owner)
            if g is None:
                g = groups[r.owner] = ProducerReads(r.owner)
            g.reads += 1
            if r.small is not None:
                la, ra, nb, ld, rd = r.small
                lshift, rshift = lid * t.local_stride, rid * t.remote_stride
                g.add_rows(tuple(a + lshift for a in la), tuple(a + rshift for a in ra),
                           nb, ld, rd, r.total_nbytes)
            else:
                g.add_rows(r.local + lid * t.local_stride, r.remote + rid * t.remote_stride,
                           r.nbytes, r.local_devs, r.remote_devs, r.total_nbytes)
        return groups


def prepare_pull(plan: TransferPlan, local_ranks: Iterable[RankPool],
                 remote_ranks: Mapping[RankId, RankPool], owners: Iterable[str] = ()
                 ) -> PreparedPull:
    """Bind `assemble_pull`'s inputs and build the one-block rows (LayoutError as
    `assemble_pull` would raise it for a remote rank the plan names but nobody has)."""
    local = tuple(local_ranks)
    rows: list[_ReadRows] | None = []
    pairs: list[tuple[RankPool, RankPool]] = []
    for lr in local:
        for read in plan.reads_for(lr.rank):
            rr = remote_ranks.get(read.remote)
            if rr is None:
                raise LayoutError(f"plan reads remote rank {read.remote.key}, which is not known")
            pairs.append((lr, rr))
            try:
                t = _block_template(read, lr.cache, lr.first_layer, rr.cache, rr.first_layer)
            except LayoutError:  # a refused read: assemble_pull refuses it per pull
                t = None
            if t is None or rows is None:
                rows = None
                continue
            n = len(t.nbytes)
            cols = (t.local + lr.base_addr, t.remote + rr.base_addr,
                    np.full(n, lr.device_id, dtype=np.int64),
                    np.full(n, rr.device_id, dtype=np.int64))
            for a in cols:
                a.setflags(write=False)
            small = (tuple(tuple(a.tolist()) for a in (cols[0], cols[1], t.nbytes, cols[2],
                                                       cols[3]))
                     if n <= SMALL_DESCRIPTORS else None)
            rows.append(_ReadRows(rr.owner, cols[0], cols[1], t.nbytes, cols[2], cols[3], t,
                                  int(t.nbytes.sum()), small))
    if not rows:  # no read at all (nothing to shift), or one without a template
        return PreparedPull(plan, local, remote_ranks, tuple(owners), None)
    local_blocks = min(r.template.local_blocks for r in rows)
    remote_blocks = min(r.template.remote_blocks for r in rows)
    tables = None
    if all(p[0].cache.block_size_tokens == p[1].cache.block_size_tokens for p in pairs):
        tables = _block_tables(rows, local_blocks, remote_blocks)
    return PreparedPull(plan, local, remote_ranks, tuple(owners), tuple(rows), local_blocks,
                        remote_blocks, tables)


def _block_tables(rows: Sequence[_ReadRows], local_blocks: int, remote_blocks: int
                  ) -> dict[str, BlockTable]:
    """Each producer's rows as one `BlockTable` (local side = destination)."""
    tables = {}
    for owner in dict.fromkeys(r.owner for r in rows):
        mine = [r for r in rows if r.owner == owner]

        def col(get: Callable[[_ReadRows], np.ndarray], mine=mine) -> np.ndarray:
            return np.concatenate([get(r) for r in mine])

        tables[owner] = BlockTable(
            dst=col(lambda r: r.local), src=col(lambda r: r.remote),
            nbytes=col(lambda r: r.nbytes),
            dst_stride=col(lambda r: np.full(len(r.nbytes), r.template.local_stride)),
            src_stride=col(lambda r: np.full(len(r.nbytes), r.template.remote_stride)),
            dst_devs=col(lambda r: r.local_devs), src_devs=col(lambda r: r.remote_devs),
            dst_blocks=local_blocks, src_blocks=remote_blocks)
    return tables

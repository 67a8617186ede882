"""What the daemon holds the bytes layer by: the protocols and the values they pass.

- `Transport`: the small interface kvd needs from NIXL (kvd.transport.remote.nixl);
- `Copier`: a copy between memory this process maps, with transfer handles
  (kvd.transport.copies: `LocalCopier` for DRAM, `CudaCopier` for VRAM);
- `Mover`: how a pull's bytes get from the producer's pools into the consumer's,
  over either of the above (kvd.daemon.pull.movers, kvd.daemon.pull.local).

The sub-packages of kvd.transport never import each other, only this module (and
kvd.daemon.pull types against these protocols, never against a copier's class:
tests/test_layers.py holds both rules).

The daemon talks to NIXL only through `Transport`; `NixlTransport` implements it with the
real agent, `LoopbackTransport` (tests) with memcpy inside one process. Every
method is called from one dedicated thread (see kvd.daemon.datapath), so
implementations need no locking.

Two ways to post a READ:

* ``post_read(ReadPost)``: a fresh descriptor list per READ (NIXL
  ``initialize_xfer``): every descriptor is validated on every post and adjacent
  descriptors are never merged.
* prepared lists: ``prepare_local(rows)`` / ``prepare_remote(peer, rows)`` once per
  (pool, peer), then ``post_prepped_read(PreppedRead)`` with two index arrays per
  READ (NIXL ``prep_xfer_dlist`` + ``make_prepped_xfer``). Validation happens once
  at prepare time, and NIXL merges consecutive indices whose descriptors are
  adjacent in memory on both sides, so consecutive blocks become one descriptor.
  Lists are described by strided rows (``DescRows``), so preparing a whole pool as
  a grid of chunks costs one row, not one tuple per chunk.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvd.errors import TransferError
from kvd.planner.blocks import BlockCopy


@dataclass
class TransportCounts:
    """Live objects, for leak checks: all must be zero after a clean shutdown."""

    registrations: int = 0
    transfers: int = 0
    peers: int = 0
    prepared_lists: int = 0


@dataclass(frozen=True)
class PostPart:
    """One posting worker's part of a striped READ: which worker (and its rail, "" none),
    how many descriptors and bytes it took (for the pull's spans and logs)."""

    worker: int
    rail: str
    descriptors: int
    nbytes: int


@dataclass(frozen=True)
class PostTiming:
    """Where the last post's time went, for "µs per descriptor" and the posting share.

    ``build_s``: descriptors and the NIXL request (``initialize_xfer`` or
    ``make_prepped_xfer``); ``transfer_s``: ``transfer()``, which on UCX cma may copy
    the whole READ inline. ``descriptors``: as posted, before NIXL merges any.
    """

    descriptors: int
    build_s: float
    transfer_s: float
    # A READ striped over posting workers: each worker's part (empty: one worker took it)
    parts: tuple[PostPart, ...] = ()


@dataclass(frozen=True)
class PoolSpan:
    """A registered pool: base address, size, device (GPU index; 0 for DRAM)."""

    base: int
    nbytes: int
    dev: int = 0


@dataclass(frozen=True)
class ReadPost:
    """One READ of many descriptors from one peer: parallel arrays, one row each.

    ``local_pools`` / ``remote_pools``: the pools the descriptors lie in (this side's
    and the peer's). Optional; with them, `kvd.transport.remote.prepped.PreppedPoster` posts
    the READ through prepared lists (adjacent descriptors merge), without them it
    falls back to a fresh list.
    """

    peer: str
    # int64 arrays; a few descriptors (kvd.planner.assembly.SMALL_DESCRIPTORS) may come as
    # tuples of ints to a local copier (NIXL posts get arrays: kvd.daemon.pull.movers)
    local_addrs: np.ndarray | tuple[int, ...]
    remote_addrs: np.ndarray | tuple[int, ...]
    nbytes: np.ndarray | tuple[int, ...]
    mem_type: str
    notif: bytes
    # GPU index per descriptor (None: all 0, DRAM)
    local_devs: np.ndarray | tuple[int, ...] | None = None
    remote_devs: np.ndarray | tuple[int, ...] | None = None
    local_pools: tuple[PoolSpan, ...] = ()
    remote_pools: tuple[PoolSpan, ...] = ()
    # This side's memory when it differs from the peer's ``mem_type`` ("": the same): a
    # local pull between a VRAM and a DRAM pool of one daemon.
    local_mem_type: str = ""
    # The same descriptors as block ids over a table prepared once per pool pair
    # (kvd.planner.blocks), for a copier that computes addresses itself; the columns
    # above may then be deferred (built when numpy converts them).
    blocks: BlockCopy | None = None


@dataclass(frozen=True)
class DescRows:
    """Descriptors of a list to prepare, as strided rows (NIXL 1.5's compressed form).

    Row ``r`` stands for ``counts[r]`` descriptors of ``nbytes[r]`` bytes each, the
    ``k``-th at ``addrs[r] + k * strides[r]`` (``strides == nbytes``: dense). A list
    index counts descriptors in that order: row 0's ``counts[0]`` first, then row 1's.
    ``devs`` is the device (GPU index) per row, None for all 0 (DRAM).
    """

    addrs: np.ndarray
    nbytes: np.ndarray
    strides: np.ndarray
    counts: np.ndarray
    mem_type: str = "DRAM"
    devs: np.ndarray | None = None

    def __post_init__(self) -> None:
        arrays = [np.asarray(a, dtype=np.int64).reshape(-1)
                  for a in (self.addrs, self.nbytes, self.strides, self.counts)]
        if len({len(a) for a in arrays}) != 1:
            raise ValueError("DescRows: addrs, nbytes, strides and counts differ in length")
        if len(arrays[0]) == 0:
            raise ValueError("DescRows: no rows")
        if (arrays[1] <= 0).any() or (arrays[3] <= 0).any() or (arrays[2] < 0).any():
            raise ValueError("DescRows: nbytes and counts must be > 0, strides >= 0")
        if (arrays[0] < 0).any():
            raise ValueError("DescRows: negative address")
        if int(arrays[3].sum()) >= 2**31:
            raise ValueError("DescRows: more than 2**31 - 1 descriptors (indices are int32)")
        for field, arr in zip(("addrs", "nbytes", "strides", "counts"), arrays, strict=True):
            object.__setattr__(self, field, arr)
        if self.devs is not None:
            devs = np.broadcast_to(np.asarray(self.devs, dtype=np.int64), arrays[0].shape)
            object.__setattr__(self, "devs", devs)

    @classmethod
    def grid(cls, addr: int, chunk_nbytes: int, count: int, stride_nbytes: int | None = None,
             mem_type: str = "DRAM", dev: int = 0) -> DescRows:
        """One row: ``count`` chunks of ``chunk_nbytes`` from ``addr`` (dense by default)."""
        stride = chunk_nbytes if stride_nbytes is None else stride_nbytes
        return cls(addrs=np.array([addr]), nbytes=np.array([chunk_nbytes]),
                   strides=np.array([stride]), counts=np.array([count]), mem_type=mem_type,
                   devs=np.array([dev]))

    @classmethod
    def of_descriptors(cls, addrs: np.ndarray, nbytes: np.ndarray, mem_type: str = "DRAM",
                       devs: np.ndarray | None = None) -> DescRows:
        """Irregular descriptors, one row each (list index = position)."""
        nbytes = np.asarray(nbytes, dtype=np.int64)
        return cls(addrs=np.asarray(addrs), nbytes=nbytes, strides=nbytes,
                   counts=np.ones(len(nbytes), dtype=np.int64), mem_type=mem_type, devs=devs)

    def __len__(self) -> int:
        return int(self.counts.sum())

    def nixl_rows(self) -> np.ndarray:
        """The (N, 5) uint64 array NIXL's ``prep_xfer_dlist`` takes as a strided list."""
        out = np.empty((len(self.addrs), 5), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 3], out[:, 4] = (self.addrs, self.nbytes, self.strides,
                                                      self.counts)
        out[:, 2] = 0 if self.devs is None else self.devs
        return out

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(addrs, nbytes, devs), one entry per descriptor, in list-index order."""
        rows = np.repeat(np.arange(len(self.counts)), self.counts)
        starts = np.cumsum(self.counts) - self.counts
        k = np.arange(len(rows), dtype=np.int64) - np.repeat(starts, self.counts)
        addrs = self.addrs[rows] + k * self.strides[rows]
        devs = (np.zeros(len(rows), dtype=np.int64) if self.devs is None
                else np.asarray(self.devs)[rows])
        return addrs, self.nbytes[rows], devs

    def extent(self) -> tuple[int, int]:
        """[lowest, highest) byte address any descriptor touches."""
        last = self.addrs + (self.counts - 1) * self.strides + self.nbytes
        return int(self.addrs.min()), int(last.max())


@dataclass(frozen=True)
class PreppedRead:
    """One READ by index into two prepared lists: local[i] <- remote[i] for each i.

    Index arrays are int32 (what NIXL takes without a copy); descriptor sizes must
    match pairwise. Consecutive indices adjacent in memory on both sides merge.
    """

    peer: str
    local_list: int
    remote_list: int
    local_indices: np.ndarray
    remote_indices: np.ndarray
    notif: bytes


def merged_count(local_addrs: np.ndarray, remote_addrs: np.ndarray, nbytes: np.ndarray) -> int:
    """Descriptors left once consecutive ones adjacent in memory on both sides merge.

    What NIXL's prepared path does to a READ's index pairs (measured: 256 consecutive
    4 KiB indices -> 1 descriptor, every other index -> 128); fresh lists never merge.
    """
    n = len(nbytes)
    if n == 0:
        return 0
    la, ra, nb = (np.asarray(a, dtype=np.int64) for a in (local_addrs, remote_addrs, nbytes))
    joined = (la[1:] == la[:-1] + nb[:-1]) & (ra[1:] == ra[:-1] + nb[:-1])
    return n - int(joined.sum())


class Transport(Protocol):
    name: str
    last_post: PostTiming | None  # timing of the most recent successful post

    def metadata(self) -> bytes:
        """Agent metadata including every registered region (refresh after registering)."""
        ...

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int: ...

    def deregister(self, reg_id: int) -> None: ...

    def add_peer(self, metadata: bytes) -> str:
        """Load (or refresh) a remote agent's metadata; returns its agent name."""
        ...

    def remove_peer(self, agent_name: str) -> None: ...

    def sever_peer(self, agent_name: str, hosts: tuple[str, ...],
                   spare_local_ports: tuple[int, ...] = (),
                   spare_remote_ports: tuple[int, ...] = ()) -> int:
        """Tear down the data connections to a peer (on ``hosts``) so that no READ to it
        can land any more; its READs then end with an error on a later poll. Returns how
        many connections were torn down: 0 means none could be, and a READ may still land.
        Connections from ``spare_local_ports`` or to ``spare_remote_ports`` (the daemon's
        own sockets) are left alone."""
        ...

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        """Post one READ of many descriptors; returns (xfer id, already done)."""
        ...

    def prepare_local(self, rows: DescRows) -> int:
        """Prepare a list over this agent's registered memory; returns a list id.

        Raises TransferError when a descriptor lies outside registered memory.
        """
        ...

    def prepare_remote(self, peer: str, rows: DescRows) -> int:
        """Prepare a list over a loaded peer's registered memory; returns a list id.

        Removing (or reloading) the peer releases its lists: prepare them again.
        """
        ...

    def release_prepared(self, list_id: int) -> None:
        """Release a prepared list (unknown ids are ignored). Posted READs are unaffected."""
        ...

    def is_prepared(self, list_id: int) -> bool:
        """Whether a list id is still valid (deregistering its memory or removing its
        peer releases a list)."""
        ...

    def post_prepped_read(self, post: PreppedRead) -> tuple[int, bool]:
        """Post one READ by indices into two prepared lists; returns (xfer id, done).

        Raises TransferError for an unknown list, a list of another peer, indices out
        of range or of different lengths, or sizes that differ pairwise.
        """
        ...

    def xfer_descriptors(self, xfer_id: int) -> int | None:
        """Descriptors of a finished transfer after NIXL merged them (None: not known)."""
        ...

    def poll(self, xfer_id: int) -> bool:
        """True when done; raises TransferError when the transfer failed."""
        ...

    def release(self, xfer_id: int) -> None:
        """Release (and abort, if still running) a transfer handle."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]: ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def counts(self) -> TransportCounts: ...

    def close(self) -> None: ...


# A posted READ's outcome, as the pull's machine reads it (values: no I/O).


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class XferStatus:
    state: XferState
    error: TransferError | None = None


@dataclass(frozen=True)
class PostResult:
    """One posted READ: a handle while it runs; done at once (its handle already
    released, so None); or the error (no handle)."""

    xfer_id: int | None
    done: bool
    error: TransferError | None = None
    timing: PostTiming | None = None  # where the post's time went (transport.last_post)


# ----------------------------------------------------------------- copies and movers

# The device id that names host (DRAM) memory in a copy between devices (a `Copier`'s
# ``dst_devs`` / ``src_devs``); GPUs are 0, 1, ...
HOST_DEVICE = -1


class Copier(Protocol):
    """Copies ``dst[i] <- src[i]`` (``nbytes[i]`` each) between memory this process maps,
    as transfer handles: `post` starts a copy (a small one may have ended when it
    returns), `poll` says whether it ended (raising TransferError when it failed),
    `release` forgets it. Any thread may call them. Implementations:
    kvd.transport.copies.localcopy.LocalCopier (DRAM; ``dst_regions`` / ``src_regions``
    bound the descriptors) and kvd.transport.copies.cudacopy.CudaCopier (``dst_devs`` /
    ``src_devs``: a GPU index per descriptor, or `HOST_DEVICE`)."""

    def post(self, dst_addrs: Any, src_addrs: Any, nbytes: Any, **where: Any) -> int:
        """Start a copy; returns its handle. ValueError for malformed descriptors,
        TransferError for ones outside the memory named, BusyError when full."""
        ...

    def poll(self, handle: int) -> bool:
        """True when the copy ended; raises TransferError when it failed."""
        ...

    def wait(self, handle: int, timeout_s: float | None = None) -> bool:
        """Block until the copy ends (or ``timeout_s``); then as `poll`."""
        ...

    def release(self, handle: int, timeout_s: float | None = None) -> None:
        """Forget a copy; one still running is waited for (a copy cannot be recalled)."""
        ...

    def close(self) -> None:
        """Wait for every copy and stop the copier's threads."""
        ...


class BlockCopier(Copier, Protocol):
    """A `Copier` that also takes a copy as block ids over a prepared table and makes the
    addresses itself (CudaCopier, on the GPU)."""

    def post_blocks(self, blocks: BlockCopy) -> int: ...


class Mover(Protocol):
    """Moves a pull's bytes and reports each transfer's end. A pull
    (kvd.daemon.pull.machine) decides what to move and when; the consumer chooses its
    mover: NIXL READs from another daemon's agent (kvd.daemon.pull.movers.NixlMover) or
    copies through a `Copier` (kvd.daemon.pull.local.LocalMover)."""

    path: str  # "remote", "local" or "host": in kvd status, the logs and the metrics' labels

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        """Whether `post_now` would post these without waiting (unless a lock is taken)."""
        ...

    def post_now(self, posts: list[ReadPost]) -> list[PostResult] | None:
        """Post inline, or None (nothing posted) when that cannot be done now."""
        ...

    async def post(self, posts: list[ReadPost]) -> list[PostResult]: ...

    async def poll(self, handles: list[int]) -> dict[int, XferStatus]: ...

    async def release(self, handles: list[int]) -> None:
        """Only handles whose transfer ended (or every one, when the daemon stops)."""
        ...

    async def sever(self, producers: Mapping[str, tuple[str, ...]]) -> None:
        """Make the transfers from these producers (agent -> control addresses) end."""
        ...

"""Copies between pools on GPUs (and DRAM) that this process maps, on CUDA streams.

The VRAM counterpart of `kvd.transport.copies.localcopy.LocalCopier`, with the same handle
semantics: ``post`` enqueues the copy and returns a handle, ``poll`` is True only once
the copy's completion has been *observed* (a CUDA event recorded after the last copy
on every stream it used has completed, and any staged host step has ended), never on a
host-side guess; ``release`` of a copy not ended waits for it (enqueued GPU copies
cannot be recalled) or raises, keeping the handle.

Descriptors carry a device per side (``HOST`` = -1 for DRAM, else the GPU index):

* **d2d** (one GPU) and **peer** (two GPUs with peer access): one **gather kernel**
  launch per lane (`GATHER_KERNEL`, compiled with NVRTC through torch off the caller's
  thread, see "Kernels" below):
  each thread block copies one chunk of at most `KERNEL_CHUNK_NBYTES` with 16-byte
  loads where the addresses allow. Measured on an H200, per-piece ``cudaMemcpyAsync``
  ran 5-8 us a piece (2 MiB blocks: 0.13x a device copy; 16 KiB pieces: 0.002x) and
  ``cudaMemcpyBatchAsync`` hardly better, while a kernel moves any shape at memory
  speed (docs/notes/2026-11-27-gpu-local-copy.md). Where NVRTC is missing the copier
  falls back to ``cudaMemcpyAsync(..., cudaMemcpyDefault)`` per merged piece on the
  destination GPU's streams (``kernel_error`` says why); peer access is enabled once per
  pair where the GPUs allow it (otherwise the driver stages through the host);
* **h2d** / **d2h** to host memory registered with the copier (`register_host`, page-
  locked with ``cudaHostRegister``): direct DMA, same as above;
* **h2d** / **d2h** to host memory not registered (a pool file of another daemon, say):
  **staged** through a few page-locked slots: the device side copies into a slot, a
  host thread moves the slot to the destination (``ctypes.memmove``), slots alternate
  so the two steps overlap; the reverse for h2d.

**Block copies** (`post_blocks`): a pull given as block ids over a `BlockTable` (one
pool pair's rows at block pair (0, 0) and their block strides,
kvd.planner.blocks). The table is cut into chunks and uploaded once per table
(`prepare_blocks`, cached per table object); a pull then uploads only its block ids
(none for one block: they travel as kernel arguments) and one launch of `BLOCK_KERNEL`
per device pair computes every address on the GPU. The host's work per pull grows with
its blocks, not with its descriptors. Where the kernel is not ready (still compiling,
no NVRTC) or a row is on the host, the copy is expanded and goes through ``post``.

**Kernels**: with ``kernel=None`` (the daemon's) both kernels are compiled for every
visible GPU on a thread started with the copier; copies posted before they are ready
take the per-piece path, and the compile time is logged (``kernel_compile_s``).
``kernel=True`` compiles at first use on the caller's thread and fails without NVRTC.

The plan (`plan_device_copy`, `stage_batches`) is pure and tested without CUDA; the
runtime (`CudaCopier`) imports torch lazily and needs a GPU. The CUDA runtime is called
through ctypes on the libcudart that torch loaded (`_cudart`), so no extra package.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import BusyError, TransferError
from kvd.planner.blocks import BlockCopy, BlockTable, check_ids
from kvd.transport.base import HOST_DEVICE
from kvd.transport.copies.copyplan import (
    MAX_PIECE_NBYTES,
    CopyPart,
    as_descriptors,
    merge_adjacent,
    plan_copy,
    small_copy,
)
from kvd.transport.copies.gather import (
    BLOCK_KERNEL,
    GATHER_KERNEL,
    KERNEL_MAX_BLOCKS,
    KERNEL_THREADS,
    block_chunks,
    chunk_descriptors,
)

log = logging.getLogger("kvd.transport")

HOST = HOST_DEVICE  # host (DRAM) memory in dst_devs / src_devs
# Page-locked staging: slots of this size, this many (a copy through unregistered host
# memory moves one slot on the GPU while the host thread empties/fills another).
STAGING_SLOT_NBYTES = 32 << 20
STAGING_SLOTS = 2
MIN_STREAM_PART_NBYTES = 16 << 20  # below this a copy stays on one stream
MAX_STREAMS_PER_DEVICE = 16
MAX_HANDLES = 65536
CUDA_MEMCPY_DEFAULT = 4
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
CUDA_HOST_REGISTER_PORTABLE = 1
# Block tables kept prepared on the GPU (one per pool pair and producer); the oldest is
# dropped past this (copies still running keep theirs alive until released).
MAX_BLOCK_TABLES = 256
# ----------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True)
class Lane:
    """Descriptors of one (source device, destination device) pair, and how they move.

    ``kind``: d2d, peer, h2d or d2h. ``device``: the GPU whose streams issue it (the
    destination's, or the source's for d2h). ``staged``: through page-locked slots
    (the host side is not registered). ``parts``: one per stream, equal bytes.
    """

    src_dev: int
    dst_dev: int
    kind: str
    device: int
    staged: bool
    parts: tuple[CopyPart, ...]

    @property
    def total(self) -> int:
        return sum(p.total for p in self.parts)


@dataclass(frozen=True)
class StageBatch:
    """One slot's worth of a staged copy: pieces (host addr, device addr, nbytes,
    offset in the slot), packed without gaps; ``nbytes`` <= the slot size."""

    pieces: tuple[tuple[int, int, int, int], ...]
    nbytes: int


def _kind(src_dev: int, dst_dev: int) -> str:
    if src_dev == HOST and dst_dev == HOST:
        raise ValueError("copy: host to host is LocalCopier's (kvd.transport.copies.localcopy)")
    if src_dev == HOST:
        return "h2d"
    if dst_dev == HOST:
        return "d2h"
    return "d2d" if src_dev == dst_dev else "peer"


def _devs(devs, n: int, side: str) -> np.ndarray:
    arr = np.broadcast_to(np.asarray(devs, dtype=np.int64), (n,)) if np.ndim(devs) == 0 \
        else np.asarray(devs, dtype=np.int64).reshape(-1)
    if len(arr) != n:
        raise ValueError(f"copy: {len(arr)} {side} devices for {n} descriptors")
    if (arr < HOST).any():
        raise ValueError(f"copy: {side} device below {HOST} (host)")
    return arr


def _within(addrs: np.ndarray, nbytes: np.ndarray,
            regions: Sequence[tuple[int, int]]) -> np.ndarray:
    ok = np.zeros(len(addrs), dtype=bool)
    for base, size in regions:
        ok |= (addrs >= base) & (addrs + nbytes <= base + size)
    return ok


def plan_device_copy(dst_addrs, src_addrs, nbytes, dst_devs, src_devs, *, streams: int = 1,
                     pinned: Sequence[tuple[int, int]] = (),
                     min_part_nbytes: int = MIN_STREAM_PART_NBYTES,
                     max_piece_nbytes: int = MAX_PIECE_NBYTES,
                     whole_kinds: frozenset[str] = frozenset()) -> tuple[Lane, ...]:
    """Group descriptors into lanes by (source device, destination device, staged),
    keeping their order, merge adjacent ones, and split each lane over ``streams``
    streams by equal bytes. ``*_devs``: one per descriptor or one for all (``HOST``
    for DRAM). ``pinned``: host regions registered with CUDA (direct DMA).
    ``whole_kinds``: lanes of these kinds stay one part, merged but not cut (the gather
    kernel cuts its own chunks). Pure; ValueError as
    `kvd.transport.copies.copyplan.as_descriptors`, and for host to host."""
    if not 1 <= streams <= MAX_STREAMS_PER_DEVICE:
        raise ValueError(f"streams must be 1..{MAX_STREAMS_PER_DEVICE}, got {streams}")
    small = small_copy(dst_addrs, src_addrs, nbytes)  # a few us instead of numpy's ~100
    if small is not None:
        dst, src, size = (np.array(col, dtype=np.int64) for col in zip(*small, strict=True))
    else:
        dst, src, size = as_descriptors(dst_addrs, src_addrs, nbytes)
    ddev, sdev = _devs(dst_devs, len(size), "destination"), _devs(src_devs, len(size),
                                                                   "source")
    host_side = np.where(sdev == HOST, src, dst)
    on_host = (sdev == HOST) | (ddev == HOST)
    staged = on_host & ~_within(host_side, size, pinned)
    keys = np.stack([sdev, ddev, staged.astype(np.int64)], axis=1)
    lanes = []
    if len(keys) and (keys == keys[0]).all():  # the usual case: one lane, no sort
        groups = [(keys[0], None)]
    else:
        uniq, first = np.unique(keys, axis=0, return_index=True)
        groups = [(key, np.flatnonzero((keys == key).all(axis=1)))
                  for key in uniq[np.argsort(first)]]
    for key, sel in groups:
        s_dev, d_dev, is_staged = (int(k) for k in key)
        kind = _kind(s_dev, d_dev)
        if sel is None:
            ld, ls, ln = merge_adjacent(dst, src, size)
        else:
            ld, ls, ln = merge_adjacent(dst[sel], src[sel], size[sel])
        if kind in whole_kinds and not is_staged:
            parts: tuple[CopyPart, ...] = (CopyPart(ld, ls, ln),)
        else:
            parts = plan_copy(ld, ls, ln, parts=1 if is_staged else streams,
                              min_part_nbytes=min_part_nbytes,
                              max_piece_nbytes=max_piece_nbytes).parts
        device = s_dev if kind == "d2h" else d_dev
        lanes.append(Lane(src_dev=s_dev, dst_dev=d_dev, kind=kind, device=device,
                          staged=bool(is_staged), parts=parts))
    return tuple(lanes)


def stage_batches(lane: Lane, slot_nbytes: int = STAGING_SLOT_NBYTES) -> list[StageBatch]:
    """A staged lane's pieces packed into slots of ``slot_nbytes`` (a piece that does
    not fit the rest of a slot is split across two). Pure."""
    if slot_nbytes < 1:
        raise ValueError("slot_nbytes must be >= 1")
    if not lane.staged:
        raise ValueError("stage_batches: lane is not staged")
    d2h = lane.kind == "d2h"
    batches: list[StageBatch] = []
    pieces: list[tuple[int, int, int, int]] = []
    used = 0
    for part in lane.parts:
        for d, s, n in zip(part.dst.tolist(), part.src.tolist(), part.nbytes.tolist(),
                           strict=True):
            host, dev = (d, s) if d2h else (s, d)
            while n:
                take = min(n, slot_nbytes - used)
                pieces.append((host, dev, take, used))
                used += take
                host, dev, n = host + take, dev + take, n - take
                if used == slot_nbytes:
                    batches.append(StageBatch(tuple(pieces), used))
                    pieces, used = [], 0
    if pieces:
        batches.append(StageBatch(tuple(pieces), used))
    return batches


# ------------------------------------------------------------ the CUDA runtime


def _cudart() -> ctypes.CDLL:
    """The libcudart torch loaded (found in /proc/self/maps), with the signatures used."""
    import torch

    torch.cuda.init()
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                path = line.split(None, 5)[-1].strip()
                break
    if path is None:  # statically linked or renamed: ask by soname
        major = (torch.version.cuda or "12").split(".")[0]
        path = f"libcudart.so.{major}"
    lib = ctypes.CDLL(path)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
    lib.cudaMemcpyAsync.restype = ctypes.c_int
    lib.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
    lib.cudaHostRegister.restype = ctypes.c_int
    lib.cudaHostUnregister.argtypes = [vp]
    lib.cudaHostUnregister.restype = ctypes.c_int
    lib.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
    lib.cudaDeviceEnablePeerAccess.restype = ctypes.c_int
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cudaRuntimeGetVersion.restype = ctypes.c_int
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    lib.cudaSetDevice.restype = ctypes.c_int
    lib.cudaFree.argtypes = [vp]
    lib.cudaFree.restype = ctypes.c_int
    return lib


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


@dataclass
class _DeviceCopy:
    events: list = field(default_factory=list)  # torch.cuda.Event, one per stream used
    tables: list = field(default_factory=list)  # kernel tables and ids the GPU still reads
    staged: object | None = None  # concurrent.futures.Future of the staged part
    abandoned: bool = False
    nbytes: int = 0
    error: BaseException | None = None


@dataclass(frozen=True)
class _BlockLane:
    """One device pair's rows of a block table, chunked and uploaded: ``chunks`` (a
    tensor on ``device``) holds ``nchunks`` rows of `block_chunks`."""

    device: int
    chunks: object
    nchunks: int


@dataclass(frozen=True)
class CudaCounts:
    handles: int
    registered_host_regions: int


class CudaCopier:
    """Device copies with transfer-handle semantics (see the module docstring).

    ``streams_per_device``: streams a large copy is spread over on each GPU.
    ``batch``: issue each stream's pieces with one ``cudaMemcpyBatchAsync`` (CUDA
    >= 12.8) instead of one ``cudaMemcpyAsync`` each; refused at start when the
    runtime lacks it. Raises TransferError when CUDA is not available.
    """

    def __init__(self, streams_per_device: int = 2, batch: bool = False,
                 slot_nbytes: int = STAGING_SLOT_NBYTES, slots: int = STAGING_SLOTS,
                 max_handles: int = MAX_HANDLES, kernel: bool | None = None,
                 _runtime: tuple | None = None) -> None:
        """``kernel``: device-to-device lanes through the gather kernel (True: required,
        TransferError if it cannot be built; None: where it builds, else per-piece
        copies; False: never). ``_runtime``: (torch-like module, cudart-like object)
        instead of torch and libcudart: the CPU suite's simulated GPU
        (tests/transport/copies/test_cudacopy_plan.py), which has no kernel."""
        if not 1 <= streams_per_device <= MAX_STREAMS_PER_DEVICE or slots < 1 \
                or slot_nbytes < 1:
            raise ValueError("streams_per_device 1..16, slots >= 1, slot_nbytes >= 1")
        if _runtime is None:
            try:
                import torch
            except ImportError as e:  # pragma: no cover - torch is a dependency
                raise TransferError(f"CUDA copies need torch: {e}") from None
            if not torch.cuda.is_available():
                raise TransferError("CUDA copies: no CUDA device visible")
            _runtime = (torch, _cudart())
        elif kernel is None and not hasattr(_runtime[0].cuda, "_compile_kernel"):
            kernel = False  # a simulated GPU without kernels
        self._torch, self._rt = _runtime
        self.kernel = kernel is not False
        self.kernel_required = kernel is True
        self.kernel_error: str | None = None
        self._kernels: dict[int, object] = {}  # device -> gather kernel
        self._block_kernels: dict[int, object] = {}  # device -> block kernel
        self._compiles: dict[int, threading.Thread] = {}
        self.kernel_compile_s: dict[int, float] = {}  # device -> seconds both kernels took
        self._tables: dict[int, tuple[BlockTable, dict[tuple[int, int], _BlockLane]]] = {}
        version = ctypes.c_int()
        self._check(self._rt.cudaRuntimeGetVersion(ctypes.byref(version)), "version")
        self.runtime_version = version.value
        self.streams_per_device = streams_per_device
        self.batch = batch
        if batch:
            self._setup_batch()
        self.slot_nbytes, self.slots = slot_nbytes, slots
        self.max_handles = max_handles
        self._streams: dict[int, list] = {}
        self._peers: set[tuple[int, int]] = set()
        self._peer_access: set[tuple[int, int]] = set()
        self._pinned: dict[int, int] = {}  # base -> nbytes, registered by us
        self._staging: list | None = None  # pinned torch tensors, one per slot
        self._copies: dict[int, _DeviceCopy] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        from concurrent.futures import ThreadPoolExecutor

        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-stage")
        self._closed = False
        self.last_lanes: tuple[Lane, ...] = ()
        self.last_block_path = ""  # "kernel" or "expanded": how the last post_blocks went
        if self.kernel and not self.kernel_required:
            for device in range(self._torch.cuda.device_count()):
                self._compile_soon(device)

    # -- setup ----------------------------------------------------------------------

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self._rt.cudaGetLastError()  # clear the sticky-free error state
            msg = self._rt.cudaGetErrorString(rc)
            raise TransferError(f"CUDA {what} failed: {rc} "
                                f"{msg.decode() if msg else 'unknown error'}")

    def _setup_batch(self) -> None:
        fn = getattr(self._rt, "cudaMemcpyBatchAsync", None)
        if fn is None or self.runtime_version < 12080:
            raise TransferError(f"cudaMemcpyBatchAsync needs CUDA >= 12.8 (runtime "
                                f"{self.runtime_version})")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        args = [ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(sz), sz,
                ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(sz), sz]
        if self.runtime_version < 13000:  # 12.8/12.9 have a failIdx out-parameter
            args.append(ctypes.POINTER(sz))
        fn.argtypes = args + [vp]
        fn.restype = ctypes.c_int
        self._batch_fn = fn

    def _stream_list(self, device: int) -> list:
        with self._lock:  # the staging thread asks too
            streams = self._streams.get(device)
            if streams is None:
                torch = self._torch
                streams = [torch.cuda.Stream(device=device)
                           for _ in range(self.streams_per_device)]
                self._streams[device] = streams
            return streams

    def _enable_peer(self, src_dev: int, dst_dev: int) -> None:
        if (src_dev, dst_dev) in self._peers:
            return
        torch = self._torch
        if torch.cuda.can_device_access_peer(dst_dev, src_dev):
            with torch.cuda.device(dst_dev):
                rc = self._rt.cudaDeviceEnablePeerAccess(src_dev, 0)
            if rc == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                self._rt.cudaGetLastError()
            else:
                self._check(rc, f"peer access {dst_dev} -> {src_dev}")
            self._peer_access.add((src_dev, dst_dev))
        self._peers.add((src_dev, dst_dev))  # without P2P the driver stages copies

    def _peer_ok(self, lane: Lane) -> bool:
        """A kernel on the destination GPU may read the source GPU's memory."""
        return (lane.src_dev, lane.dst_dev) in self._peer_access

    def register_host(self, addr: int, nbytes: int) -> None:
        """Page-lock a host region (a DRAM pool) so copies to and from it are direct
        DMA rather than staged. Idempotent per base address."""
        if addr in self._pinned:
            return
        self._check(self._rt.cudaHostRegister(addr, nbytes, CUDA_HOST_REGISTER_PORTABLE),
                    f"cudaHostRegister({addr:#x}, {nbytes})")
        self._pinned[addr] = nbytes

    def unregister_host(self, addr: int) -> None:
        """Undo `register_host`; refused while a copy of this copier is unreleased
        (it may still DMA into that memory)."""
        if addr not in self._pinned:
            return
        with self._lock:
            if self._copies:
                raise TransferError("unregister_host: copies not yet released")
        self._check(self._rt.cudaHostUnregister(addr), f"cudaHostUnregister({addr:#x})")
        del self._pinned[addr]

    # -- the handle interface -------------------------------------------------------

    def post(self, dst_addrs, src_addrs, nbytes, *, dst_devs, src_devs) -> int:
        """Enqueue ``dst[i] <- src[i]``; ``*_devs``: GPU index per descriptor (or one
        for all), ``HOST`` (-1) for DRAM. Returns a handle. Raises ValueError for
        malformed descriptors, TransferError when CUDA refuses a copy (what was
        enqueued before still completes: the handle then polls as failed) or the
        copier is closed, BusyError past ``max_handles``."""
        whole = (frozenset(("d2d", "peer")) if self.kernel and self.kernel_error is None
                 else frozenset())
        lanes = plan_device_copy(dst_addrs, src_addrs, nbytes, dst_devs, src_devs,
                                 streams=self.streams_per_device,
                                 pinned=tuple(self._pinned.items()), whole_kinds=whole)
        self.last_lanes = lanes
        handle, copy = self._new_handle(sum(lane.total for lane in lanes))
        staged = [lane for lane in lanes if lane.staged]
        try:
            for lane in lanes:
                if lane.staged:
                    continue
                if lane.kind == "peer":
                    self._enable_peer(lane.src_dev, lane.dst_dev)
                self._issue(copy, lane)
        except TransferError as e:
            copy.error = e  # already-enqueued copies still run: poll waits for them
        if staged and copy.error is None:
            copy.staged = self._stager.submit(self._run_staged, copy, staged)
        return handle

    def _new_handle(self, nbytes: int) -> tuple[int, _DeviceCopy]:
        with self._lock:
            if self._closed:
                raise TransferError("CUDA copier is closed")
            if len(self._copies) >= self.max_handles:
                raise BusyError(f"{len(self._copies)} device copies unreleased "
                                f"(at most {self.max_handles})")
            handle = next(self._ids)
            copy = _DeviceCopy(nbytes=nbytes)
            self._copies[handle] = copy
        return handle, copy

    def post_blocks(self, blocks: BlockCopy) -> int:
        """Enqueue a copy given as block ids over a block table (module docstring):
        one kernel launch per device pair, the addresses computed on the GPU. Where the
        block kernel cannot take it (not compiled yet, no NVRTC, a side on the host)
        the copy is expanded and posted as ``post`` would. Same handle semantics and
        errors as ``post`` (ValueError for ids out of the table's blocks or a
        destination block named twice)."""
        table = blocks.table
        dst_ids, src_ids = check_ids(table, blocks.dst_ids, blocks.src_ids)
        lanes = self.prepare_blocks(table)
        if lanes is None:
            self.last_block_path = "expanded"
            d, s, n, dd, sd = BlockCopy(table, dst_ids, src_ids).expand()
            return self.post(d, s, n, dst_devs=dd, src_devs=sd)
        self.last_block_path = "kernel"
        handle, copy = self._new_handle(len(dst_ids) * table.block_nbytes)
        try:
            ids: dict[int, object] = {}  # device -> the ids on it (one upload per GPU)
            for lane in lanes.values():
                self._issue_blocks(copy, lane, dst_ids, src_ids, ids)
        except TransferError as e:
            copy.error = e  # what was enqueued still runs: poll waits for it
        return handle

    def prepare_blocks(self, table: BlockTable) -> dict[tuple[int, int], _BlockLane] | None:
        """The table's rows grouped by (source, destination) GPU, chunked and uploaded
        once (cached per table object); None where the block kernel cannot take them
        (not ready yet: asked again next time; a host side; a GPU pair without peer
        access)."""
        hit = self._tables.get(id(table))
        if hit is not None and hit[0] is table:
            return hit[1]
        if not self.kernel or self.kernel_error is not None:
            return None
        pairs = np.stack([table.src_devs, table.dst_devs], axis=1)
        keys = [tuple(int(v) for v in k) for k in np.unique(pairs, axis=0)]
        for src_dev, dst_dev in keys:
            if src_dev == HOST or dst_dev == HOST:
                return None
            if src_dev != dst_dev:
                self._enable_peer(src_dev, dst_dev)
                if (src_dev, dst_dev) not in self._peer_access:
                    return None
            if self._kernel_for(dst_dev, self._block_kernels) is None:
                return None
        torch = self._torch
        lanes: dict[tuple[int, int], _BlockLane] = {}
        for src_dev, dst_dev in keys:
            sel = (table.src_devs == src_dev) & (table.dst_devs == dst_dev)
            sub = table if sel.all() else BlockTable(
                table.dst[sel], table.src[sel], table.nbytes[sel], table.dst_stride[sel],
                table.src_stride[sel], dst_dev, src_dev, table.dst_blocks, table.src_blocks)
            chunks = block_chunks(sub)
            with torch.cuda.device(dst_dev):
                on_gpu = torch.from_numpy(chunks).to(f"cuda:{dst_dev}")  # once, synchronous
            lanes[(src_dev, dst_dev)] = _BlockLane(dst_dev, on_gpu, len(chunks))
        if len(self._tables) >= MAX_BLOCK_TABLES:
            self._tables.pop(next(iter(self._tables)))
        self._tables[id(table)] = (table, lanes)
        return lanes

    def _issue_blocks(self, copy: _DeviceCopy, lane: _BlockLane, dst_ids: np.ndarray,
                      src_ids: np.ndarray, ids: dict[int, object]) -> None:
        torch = self._torch
        device = lane.device
        kernel = self._block_kernels[device]
        stream = self._stream_list(device)[0]
        n = len(dst_ids)
        with torch.cuda.device(device):
            stream.wait_stream(torch.cuda.current_stream(device))  # as in _issue
            try:
                if n == 1:  # the ids travel as arguments: nothing to upload
                    args = [lane.chunks, lane.nchunks, lane.chunks, 0, int(dst_ids[0]),
                            int(src_ids[0])]
                else:
                    on_gpu = ids.get(device)
                    if on_gpu is None:
                        both = np.concatenate([dst_ids, src_ids]).astype(np.int32)
                        host = torch.from_numpy(both).pin_memory()
                        with torch.cuda.stream(stream):
                            on_gpu = host.to(f"cuda:{device}", non_blocking=True)
                        copy.tables += [host, on_gpu]  # dropped at release
                        ids[device] = on_gpu
                    args = [lane.chunks, lane.nchunks, on_gpu, n, 0, 0]
                kernel(grid=(min(n * lane.nchunks, KERNEL_MAX_BLOCKS), 1, 1),
                       block=(KERNEL_THREADS, 1, 1), args=args, stream=stream)
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001 - a launch CUDA refused
                raise TransferError(f"block kernel launch: {type(e).__name__}: {e}") from None
            finally:
                event = torch.cuda.Event()
                event.record(stream)
                copy.events.append(event)

    # -- kernels --------------------------------------------------------------------

    def _compile(self, device: int, own_thread: bool = False) -> None:
        """Build both kernels for ``device`` (NVRTC through torch), timed and logged; on
        failure ``kernel_error`` says why (raised as TransferError if required)."""
        torch = self._torch
        t0 = time.perf_counter()
        try:
            if own_thread:
                # A new thread has no current CUDA context, and torch's device guard sets
                # none when the index already matches: without this, loading the module
                # fails with "invalid device context" (seen on an H200).
                self._check(self._rt.cudaSetDevice(device), f"cudaSetDevice({device})")
                self._check(self._rt.cudaFree(None), "context start")
            with torch.cuda.device(device):
                gather = torch.cuda._compile_kernel(GATHER_KERNEL, "kvd_gather_copy")
                blocks = torch.cuda._compile_kernel(BLOCK_KERNEL, "kvd_block_copy")
        except Exception as e:  # noqa: BLE001 - no NVRTC, old torch, ...: fall back
            self.kernel_error = f"{type(e).__name__}: {e}"
            log.warning("CUDA copy kernels unavailable on GPU %d (per-piece copies): %s",
                        device, self.kernel_error)
            if self.kernel_required:
                raise TransferError(f"CUDA gather kernel: {self.kernel_error}") from None
            return
        elapsed = time.perf_counter() - t0
        self.kernel_compile_s[device] = elapsed
        self._block_kernels[device] = blocks
        self._kernels[device] = gather  # last: a kernel here means both are ready
        log.info("CUDA copy kernels ready on GPU %d: compiled in %.3f s", device, elapsed)

    def _compile_soon(self, device: int) -> None:
        """Compile for ``device`` on a thread of its own (once): never on the caller's."""
        with self._lock:
            if device in self._compiles:
                return
            thread = threading.Thread(target=self._compile, args=(device, True), daemon=True,
                                      name=f"kvd-nvrtc-{device}")
            self._compiles[device] = thread
        thread.start()

    def wait_kernels(self, timeout_s: float | None = None) -> bool:
        """Block until the compiles started so far end (benchmarks, tests); True when
        every GPU's kernels are ready."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in list(self._compiles.values()):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return (self.kernel and self.kernel_error is None
                and all(d in self._kernels for d in self._compiles))

    def _kernel_for(self, device: int, kernels: dict[int, object]):
        """The kernel of ``kernels`` on ``device``, or None (and the per-piece path)
        while it is compiling or where NVRTC cannot build it."""
        if not self.kernel or self.kernel_error is not None:
            return None
        k = kernels.get(device)
        if k is None:
            if self.kernel_required:
                self._compile(device)  # raises without NVRTC
                return kernels.get(device)
            self._compile_soon(device)
        return k

    def _gather_kernel(self, device: int):
        return self._kernel_for(device, self._kernels)

    def _launch(self, copy: _DeviceCopy, lane: Lane, kernel, stream) -> None:
        torch = self._torch
        parts = lane.parts
        if len(parts) == 1:
            table = chunk_descriptors(parts[0].dst, parts[0].src, parts[0].nbytes)
        else:
            table = chunk_descriptors(np.concatenate([p.dst for p in parts]),
                                      np.concatenate([p.src for p in parts]),
                                      np.concatenate([p.nbytes for p in parts]))
        host = torch.from_numpy(table).pin_memory()
        with torch.cuda.stream(stream):  # the upload and the kernel, in this order
            on_gpu = host.to(f"cuda:{lane.device}", non_blocking=True)
        copy.tables += [host, on_gpu]  # dropped at release, once the kernel has ended
        n = len(table)
        kernel(grid=(min(n, KERNEL_MAX_BLOCKS), 1, 1), block=(KERNEL_THREADS, 1, 1),
               args=[on_gpu, n], stream=stream)

    def _issue(self, copy: _DeviceCopy, lane: Lane) -> None:
        torch = self._torch
        streams = self._stream_list(lane.device)
        kernel = None
        if lane.kind == "d2d" or (lane.kind == "peer" and self._peer_ok(lane)):
            kernel = self._gather_kernel(lane.device)
        with torch.cuda.device(lane.device):
            # Ordered after what this thread already queued on the device (a pool's
            # zeroing, a test's fill): the copier's streams are its own.
            current = torch.cuda.current_stream(lane.device)
            if kernel is not None:
                stream = streams[0]
                stream.wait_stream(current)
                try:
                    self._launch(copy, lane, kernel, stream)
                except TransferError:
                    raise
                except Exception as e:  # noqa: BLE001 - a launch CUDA refused
                    raise TransferError(f"gather kernel launch: {type(e).__name__}: "
                                        f"{e}") from None
                finally:
                    event = torch.cuda.Event()
                    event.record(stream)
                    copy.events.append(event)
                return
            for part, stream in zip(lane.parts, streams, strict=False):
                stream.wait_stream(current)
                try:
                    self._enqueue(part.dst, part.src, part.nbytes, stream, lane)
                finally:  # also after a refused copy: what was enqueued is tracked
                    event = torch.cuda.Event()
                    event.record(stream)
                    copy.events.append(event)

    def _enqueue(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream,
                 lane: Lane) -> None:
        handle = stream.cuda_stream
        if self.batch and len(nbytes) > 1:
            n = len(nbytes)
            dsts = (ctypes.c_void_p * n)(*dst.tolist())
            srcs = (ctypes.c_void_p * n)(*src.tolist())
            sizes = (ctypes.c_size_t * n)(*nbytes.tolist())
            attr = _MemcpyAttributes()
            attr.srcAccessOrder = 1  # cudaMemcpySrcAccessOrderStream
            for loc, dev in ((attr.srcLocHint, lane.src_dev), (attr.dstLocHint, lane.dst_dev)):
                loc.type, loc.id = (2, 0) if dev == HOST else (1, dev)
            idx = (ctypes.c_size_t * 1)(0)
            args = [dsts, srcs, sizes, n, ctypes.byref(attr), idx, 1]
            if self.runtime_version < 13000:
                fail = ctypes.c_size_t(0)
                args.append(ctypes.byref(fail))
            self._check(self._batch_fn(*args, handle), f"cudaMemcpyBatchAsync of {n}")
            return
        memcpy = self._rt.cudaMemcpyAsync
        for d, s, k in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
            rc = memcpy(d, s, k, CUDA_MEMCPY_DEFAULT, handle)
            if rc:
                self._check(rc, f"cudaMemcpyAsync({d:#x} <- {s:#x}, {k})")

    def _staging_slots(self) -> list:
        if self._staging is None:
            torch = self._torch
            self._staging = [torch.empty(self.slot_nbytes, dtype=torch.uint8, pin_memory=True)
                             for _ in range(self.slots)]
        return self._staging

    def _run_staged(self, copy: _DeviceCopy, lanes: list[Lane]) -> None:
        """On the staging thread: each staged lane through the page-locked slots."""
        slots = self._staging_slots()
        for lane in lanes:
            stream = self._stream_list(lane.device)[0]
            d2h = lane.kind == "d2h"
            pending: deque = deque()  # (event, batch, slot address), oldest first
            try:
                self._stage_lane(copy, lane, stream, slots, d2h, pending)
            finally:  # abandoned or failed: nothing enqueued may land after we end
                for event, _, _ in pending:
                    event.synchronize()

    def _stage_lane(self, copy: _DeviceCopy, lane: Lane, stream, slots: list, d2h: bool,
                    pending: deque) -> None:
        torch = self._torch
        raw = stream.cuda_stream
        with torch.cuda.device(lane.device):
            for i, batch in enumerate(stage_batches(lane, self.slot_nbytes)):
                if copy.abandoned:
                    raise TransferError("abandoned before it ended")
                if len(pending) == len(slots):  # reuse the oldest slot once it is done
                    self._finish_slot(pending.popleft(), d2h)
                slot = slots[i % len(slots)].data_ptr()
                if not d2h:
                    for host, _, n, off in batch.pieces:
                        ctypes.memmove(slot + off, host, n)
                try:
                    for _, dev, n, off in batch.pieces:
                        dst, src = (slot + off, dev) if d2h else (dev, slot + off)
                        self._check(self._rt.cudaMemcpyAsync(dst, src, n, CUDA_MEMCPY_DEFAULT,
                                                             raw), f"staged {lane.kind} copy")
                finally:  # tracked even when CUDA refused a piece
                    event = torch.cuda.Event()
                    event.record(stream)
                    pending.append((event, batch, slot))
            while pending:
                self._finish_slot(pending.popleft(), d2h)

    @staticmethod
    def _finish_slot(entry, d2h: bool) -> None:
        event, batch, slot = entry
        event.synchronize()
        if d2h:
            for host, _, n, off in batch.pieces:
                ctypes.memmove(host, slot + off, n)

    def poll(self, handle: int) -> bool:
        """True once every stream's event has completed and the staged part ended;
        raises TransferError if the copy failed (only once nothing of it can still
        land) or for an unknown handle."""
        copy = self._get(handle)
        if not all(e.query() for e in copy.events):
            return False
        if copy.staged is not None:
            if not copy.staged.done():
                # Yield the GIL to the staging thread: a caller polling in a loop would
                # otherwise hold it for whole switch intervals (5 ms) between the
                # thread's steps (measured: 0.2 GB/s staged on an H200 under a spinning
                # poll; the simulated GPU: 0.2 -> 2.4 GB/s when the caller waits).
                time.sleep(0)
                return False
            exc = copy.staged.exception()
            if exc is not None and copy.error is None:
                copy.error = exc
        if copy.error is not None:
            raise TransferError(f"device copy failed: {copy.error}") from copy.error
        return True

    def _ended(self, copy: _DeviceCopy) -> bool:
        return all(e.query() for e in copy.events) and (copy.staged is None
                                                        or copy.staged.done())

    def wait(self, handle: int, timeout_s: float | None = None) -> bool:
        """Block until the copy ends (tests, benchmarks); then as ``poll``."""
        copy = self._get(handle)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for e in copy.events:
            e.synchronize()
        if copy.staged is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                copy.staged.exception(timeout=left)
            except TimeoutError:
                return False
        return self.poll(handle)

    def release(self, handle: int, timeout_s: float | None = None) -> None:
        """Forget a copy. One not ended is abandoned (its staged batches not started
        never run) and waited for, since copies enqueued on a GPU cannot be recalled;
        still running after ``timeout_s``: TransferError, handle kept."""
        copy = self._get(handle)
        if not self._ended(copy):
            copy.abandoned = True
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not self._ended(copy):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TransferError(f"device copy {handle} still running after "
                                        f"{timeout_s} s: not released")
                time.sleep(0.0002)
        with self._lock:
            self._copies.pop(handle, None)

    def counts(self) -> CudaCounts:
        with self._lock:
            return CudaCounts(handles=len(self._copies),
                              registered_host_regions=len(self._pinned))

    def close(self) -> None:
        """Wait for every copy (GPU copies cannot be recalled), stop the staging
        thread, unregister host regions. Handles stay valid for poll/release."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            copies = list(self._copies.values())
        for copy in copies:
            copy.abandoned = True
            for e in copy.events:
                e.synchronize()
        self._stager.shutdown(wait=True)
        for addr in list(self._pinned):
            self._rt.cudaHostUnregister(addr)
            del self._pinned[addr]

    def _get(self, handle: int) -> _DeviceCopy:
        copy = self._copies.get(handle)
        if copy is None:
            raise TransferError(f"unknown device copy handle {handle!r}")
        return copy

    def __enter__(self) -> CudaCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Copies between two pools mapped in this process, with transfer-handle semantics.

When a consumer pulls from a producer whose pool this daemon maps too (same daemon,
or a pool file reachable on the same host), no network is needed: the bytes move with
plain copy calls. `LocalCopier` does that with the shape of a `Transport` READ, so a
puller can treat it as another mover: ``post`` returns a handle, ``poll`` says when it
ended (raising `TransferError` if it failed), ``release`` forgets it.

How: `kvd.transport.copies.copyplan.plan_copy` merges adjacent descriptors and cuts the copy
into one share of equal bytes per copy thread; each thread copies its share with
the batched memcpy of `kvd.transport.copies.nativecopy` (one C call per ~8 MiB of
descriptors, GIL released), or, where no C compiler built it, ``ctypes.memmove`` per
descriptor (also GIL-free, but ~0.6 us of Python per descriptor).
A copy of at most ``inline_max_nbytes`` runs on the caller's thread inside ``post``
(a thread hop costs more than copying 1 MiB) and comes back already done: with the
batched memcpy, as one call over the validated descriptors, unplanned. Measured
against numpy, torch and NIXL's own local transfer in
docs/notes/2026-11-27-local-copy.md.

Safety: memory a copy may still write is never declared free. ``release`` of a copy
that has not ended abandons its pieces not yet started and waits for the ones
running (a piece is at most `MAX_PIECE_NBYTES`); if they do not end within
``timeout_s`` it raises `TransferError` and keeps the handle, so the caller keeps the
memory too. Addresses are trusted (a wild address crashes the process, as with any
memcpy): pass ``dst_regions`` / ``src_regions`` to have every descriptor checked
against the pools first.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import BusyError, TransferError
from kvd.transport.copies.copyplan import (
    MAX_PIECE_NBYTES,
    CopyPart,
    CopyPlan,
    as_descriptors,
    plan_copy,
    small_copy,
)
from kvd.transport.copies.nativecopy import load_batch_copy

# Copies up to this size run inside post(): a copy thread's wake-up costs 20-100 µs on
# a busy host, more than memcpy takes for 1 MiB (~60 µs at 16 GB/s).
INLINE_MAX_NBYTES = 1 << 20
# auto: the batched memcpy in C where it builds (kvd.transport.copies.nativecopy), else memmove.
PRIMITIVES = ("auto", "native", "memmove")
MAX_COPY_THREADS = 64
MAX_HANDLES = 65536

CopyFn = Callable[[int, int, int], object]  # (dst, src, nbytes)


def memmove_copy(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


# The end of every copy that ran inside post(): ended before it was posted (an Event
# costs a few µs to make, a one-block pull's whole copy takes ~50).
_ENDED = threading.Event()
_ENDED.set()


@dataclass
class _Copy:
    """One posted copy: its parts, and how far they got."""

    parts: tuple[CopyPart, ...]
    nbytes: int
    pending: int  # parts not ended (queued or running)
    running: int = 0
    abandoned: bool = False
    error: BaseException | None = None
    ended: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class CopierCounts:
    """Live objects, for leak checks: zero handles after every copy is released."""

    handles: int
    running: int  # handles whose copy has not ended
    queued_parts: int


def _check_regions(addrs: np.ndarray, nbytes: np.ndarray,
                   regions: Sequence[tuple[int, int]], side: str) -> None:
    ends = addrs + nbytes
    ok = np.zeros(len(addrs), dtype=bool)
    for base, size in regions:
        ok |= (addrs >= base) & (ends <= base + size)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise TransferError(f"local copy: {side} descriptor {bad} "
                            f"[{int(addrs[bad]):#x}, +{int(nbytes[bad])}) lies outside the "
                            f"{side} pool")


class LocalCopier:
    """A copy engine over ``threads`` copy threads (see the module docstring).

    ``post``/``poll``/``release`` may be called from any thread; handles are ints.
    ``copy_fn`` is the primitive (default ``ctypes.memmove``), injectable for tests.
    """

    def __init__(self, threads: int = 1, inline_max_nbytes: int = INLINE_MAX_NBYTES,
                 max_handles: int = MAX_HANDLES, copy_fn: CopyFn | None = None,
                 max_piece_nbytes: int = MAX_PIECE_NBYTES, primitive: str = "auto") -> None:
        if not 1 <= threads <= MAX_COPY_THREADS:
            raise ValueError(f"threads must be 1..{MAX_COPY_THREADS}, got {threads}")
        if inline_max_nbytes < 0 or max_handles < 1 or max_piece_nbytes < 1:
            raise ValueError("inline_max_nbytes must be >= 0, max_handles and "
                             "max_piece_nbytes >= 1")
        if primitive not in PRIMITIVES:
            raise ValueError(f"primitive must be one of {PRIMITIVES}, got {primitive!r}")
        self.threads = threads
        self.inline_max_nbytes = inline_max_nbytes
        self.max_handles = max_handles
        self.max_piece_nbytes = max_piece_nbytes
        self._copy_fn = copy_fn or memmove_copy
        self._batch = None
        if copy_fn is not None:
            self.primitive = "custom"
        elif primitive == "memmove":
            self.primitive = "memmove"
        else:
            self._batch = load_batch_copy()
            if self._batch is None and primitive == "native":
                raise TransferError("local copier: the batched memcpy could not be built "
                                    "(no C compiler?); use primitive auto or memmove")
            self.primitive = "memmove" if self._batch is None else "native"
        self._copies: dict[int, _Copy] = {}
        self._queue: deque[tuple[_Copy, CopyPart]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._closed = False
        self.last_plan: CopyPlan | None = None
        self._workers = [threading.Thread(target=self._run, name=f"kvd-copy{i}", daemon=True)
                         for i in range(threads)]
        for t in self._workers:
            t.start()

    # -- the handle interface -------------------------------------------------------

    def post(self, dst_addrs: np.ndarray, src_addrs: np.ndarray, nbytes: np.ndarray, *,
             dst_regions: Sequence[tuple[int, int]] | None = None,
             src_regions: Sequence[tuple[int, int]] | None = None) -> int:
        """Start copying ``dst[i] <- src[i]`` (``nbytes[i]`` each); returns a handle.

        Raises ValueError for malformed descriptors (lengths differ, sizes <= 0,
        destinations overlapping), TransferError for a descriptor outside the given
        regions or after close, BusyError when ``max_handles`` copies are unreleased.
        A copy of at most ``inline_max_nbytes`` has ended when this returns.
        """
        inline_max = self.inline_max_nbytes
        small = small_copy(dst_addrs, src_addrs, nbytes)
        if small is not None and sum(k for _, _, k in small) <= inline_max:
            return self._post_inline(small, dst_regions, src_regions)
        if small is None and self._batch is not None:
            dst, src, size = as_descriptors(dst_addrs, src_addrs, nbytes)
            total = int(size.sum())
            if total <= inline_max:
                return self._post_batch(dst, src, size, total, dst_regions, src_regions)
        plan = plan_copy(dst_addrs, src_addrs, nbytes, parts=self.threads,
                         max_piece_nbytes=self.max_piece_nbytes)
        if dst_regions is not None or src_regions is not None:
            for part in plan.parts:
                if dst_regions is not None:
                    _check_regions(part.dst, part.nbytes, dst_regions, "destination")
                if src_regions is not None:
                    _check_regions(part.src, part.nbytes, src_regions, "source")
        self.last_plan = plan
        inline = plan.total <= inline_max
        copy = _Copy(parts=plan.parts, nbytes=plan.total,
                     pending=0 if inline else len(plan.parts))
        with self._lock:
            handle = self._admit(copy)
            if not inline:
                self._queue.extend((copy, part) for part in plan.parts)
                self._wake.notify(len(plan.parts))
        if inline:
            try:
                for part in plan.parts:
                    self._copy_part(copy, part)
            except Exception as e:  # noqa: BLE001 - reported on poll, like a failed READ
                copy.error = e
            copy.ended.set()
        return handle

    def _admit(self, copy: _Copy) -> int:
        """A handle for ``copy`` (the lock held): refused once closed or when
        ``max_handles`` copies are unreleased."""
        if self._closed:
            raise TransferError("local copier is closed")
        if len(self._copies) >= self.max_handles:
            raise BusyError(f"{len(self._copies)} local copies unreleased "
                            f"(at most {self.max_handles})")
        handle = next(self._ids)
        self._copies[handle] = copy
        return handle

    def _post_inline(self, rows: list[tuple[int, int, int]],
                     dst_regions: Sequence[tuple[int, int]] | None,
                     src_regions: Sequence[tuple[int, int]] | None) -> int:
        """A short copy on the caller's thread, no numpy: one block in a few µs."""
        for i, (d, s, k) in enumerate(rows):
            for side, addr, regions in (("destination", d, dst_regions),
                                        ("source", s, src_regions)):
                if regions is not None and not any(base <= addr and addr + k <= base + size
                                                   for base, size in regions):
                    raise TransferError(f"local copy: {side} descriptor {i} "
                                        f"[{addr:#x}, +{k}) lies outside the {side} pool")
        copy = _Copy(parts=(), nbytes=sum(k for _, _, k in rows), pending=0, ended=_ENDED)
        with self._lock:
            handle = self._admit(copy)
        try:
            for d, s, k in rows:
                self._copy_fn(d, s, k)
        except Exception as e:  # noqa: BLE001 - reported on poll, like a failed READ
            copy.error = e
        copy.ended.set()
        return handle

    def _post_batch(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray, total: int,
                    dst_regions: Sequence[tuple[int, int]] | None,
                    src_regions: Sequence[tuple[int, int]] | None) -> int:
        """A copy run inline as one batched memcpy call over the validated descriptors:
        no plan (its merging and cutting into shares and pieces cost more than the
        copy saves at this size: ~130 µs of a 3.2 MB, 200-descriptor copy's ~550 µs)."""
        if dst_regions is not None:
            _check_regions(dst, size, dst_regions, "destination")
        if src_regions is not None:
            _check_regions(src, size, src_regions, "source")
        copy = _Copy(parts=(), nbytes=total, pending=0, ended=_ENDED)
        with self._lock:
            handle = self._admit(copy)
        try:
            self._batch(dst, src, size)
        except Exception as e:  # noqa: BLE001 - reported on poll, like a failed READ
            copy.error = e
        return handle

    def poll(self, handle: int) -> bool:
        """True once the copy has ended; raises TransferError if it failed (or for an
        unknown handle)."""
        copy = self._get(handle)
        if not copy.ended.is_set():
            return False
        if copy.error is not None:
            raise TransferError(f"local copy failed: {copy.error}") from copy.error
        return True

    def wait(self, handle: int, timeout_s: float | None = None) -> bool:
        """Block until the copy ends (tests, benchmarks); then as ``poll``."""
        self._get(handle).ended.wait(timeout_s)
        return self.poll(handle)

    def release(self, handle: int, timeout_s: float | None = None) -> None:
        """Forget a copy. One that has not ended is abandoned: its pieces not yet
        started never run, and this waits (up to ``timeout_s``; None: until they end)
        for the running ones. If they are still running then, raises TransferError and
        keeps the handle: the memory must not be handed back yet. Unknown handles
        raise TransferError."""
        copy = self._get(handle)
        if not copy.ended.is_set():
            with self._lock:
                copy.abandoned = True
                kept = [(c, p) for c, p in self._queue if c is not copy]
                dropped = len(self._queue) - len(kept)
                if dropped:
                    self._queue = deque(kept)
                    copy.pending -= dropped
                    if copy.error is None:
                        copy.error = TransferError("abandoned before it ended")
                    if copy.pending == 0:
                        copy.ended.set()
            if not copy.ended.wait(timeout_s):
                raise TransferError(f"local copy {handle} still running after "
                                    f"{timeout_s} s: not released")
        with self._lock:
            self._copies.pop(handle, None)

    def counts(self) -> CopierCounts:
        with self._lock:
            return CopierCounts(handles=len(self._copies),
                                running=sum(not c.ended.is_set()
                                            for c in self._copies.values()),
                                queued_parts=len(self._queue))

    def close(self, timeout_s: float | None = None) -> None:
        """Abandon queued copies, wait for running pieces, stop the threads. Handles
        stay valid for poll/release (an abandoned copy polls as failed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for copy, _ in self._queue:
                copy.pending -= 1
                copy.abandoned = True
                if copy.error is None:
                    copy.error = TransferError("local copier closed before the copy ended")
                if copy.pending == 0:
                    copy.ended.set()
            self._queue.clear()
            self._wake.notify_all()
        for t in self._workers:
            t.join(timeout_s)

    def __enter__(self) -> LocalCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the copy threads ---------------------------------------------------------

    def _get(self, handle: int) -> _Copy:
        copy = self._copies.get(handle)
        if copy is None:
            raise TransferError(f"unknown local copy handle {handle!r}")
        return copy

    def _copy_part(self, copy: _Copy, part: CopyPart) -> None:
        if self._batch is not None:
            # Batches of about max_piece_nbytes: one GIL-free call each, and a copy
            # being abandoned stops within one batch.
            group = (np.cumsum(part.nbytes) - 1) // self.max_piece_nbytes
            bounds = np.flatnonzero(np.diff(group)) + 1
            dst, src, size = (np.ascontiguousarray(a, dtype=np.int64)
                              for a in (part.dst, part.src, part.nbytes))
            for lo, hi in zip(np.concatenate(([0], bounds)).tolist(),
                              np.concatenate((bounds, [len(size)])).tolist(), strict=True):
                if copy.abandoned:
                    raise TransferError("abandoned before it ended")
                self._batch(dst[lo:hi], src[lo:hi], size[lo:hi])
            return
        fn = self._copy_fn
        for dst, src, n in zip(part.dst.tolist(), part.src.tolist(), part.nbytes.tolist(),
                               strict=True):
            if copy.abandoned:
                raise TransferError("abandoned before it ended")
            fn(dst, src, n)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                copy, part = self._queue.popleft()
                copy.running += 1
            error = None
            try:
                self._copy_part(copy, part)
            except Exception as e:  # noqa: BLE001 - reported on poll
                error = e
            with self._lock:
                copy.running -= 1
                copy.pending -= 1
                if error is not None and copy.error is None:
                    copy.error = error
                if copy.pending == 0:
                    copy.ended.set()

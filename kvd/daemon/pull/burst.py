"""The small copies of a burst of local pulls, run together when the burst has been read.

A decode engine's step sends its pulls back to back (six requests decoded together: six
Pull messages within a millisecond). Copied one by one as each message is read, inside
its handler, each pull ended and reported before the next one was even read: the first
event went out alone, woke the engine's worker for it, and the daemon's loop, preempted
by that worker and by ZMQ's I/O thread on a busy host, took the rest one at a time (run
4 of docs/notes/2026-11-28-handover-runs.md: the six events of a batch over 23-94 ms
where two daemons, whose Acquire round trip batches them by accident, sent theirs within
0.5 ms). Here a pull that comes while more messages wait on the engine face (or while
copies of the burst are queued) queues its copy instead; the queue runs as one piece of
work when the face has read the burst (the loop's next turn), so the burst's pulls
report in one loop turn and their events leave in one reply.

A single pull (nothing waiting) is copied inline as before: no extra loop turn.
Memory rules: a queued copy has not started, so releasing it (a pull failed or drained
before the flush) drops it; nothing is ever written after its release.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from kvd.errors import KvdError, TransferError
from kvd.transport.base import Copier, XferState, XferStatus

# Deferred handles are negative: they never meet a copier's own (positive) handles.
_ids = itertools.count(-1, -1)


class BurstCopies:
    """Copies queued by `defer`, run by the loop's next turn (`flush`), in order."""

    def __init__(self) -> None:
        self._queue: list[tuple[int, Copier, tuple[Any, ...], dict[str, Any]]] = []
        # handle -> None (queued), True (done), TransferError (failed), or (copier, its
        # handle) for a copy that did not end inside post(), polled as usual
        self._state: dict[int, object] = {}
        self._wakes: dict[int, asyncio.Future[None]] = {}
        self.flushes = 0  # flushes run (tests, and the bench's counters)
        self.copies = 0  # copies run by them

    def __contains__(self, handle: int) -> bool:
        return handle in self._state

    @property
    def queued(self) -> bool:
        return bool(self._queue)

    def defer(self, copier: Copier, args: tuple[Any, ...], extra: dict[str, Any]
              ) -> tuple[int, asyncio.Future[None]]:
        """Queue ``copier.post(*args, **extra)``; its handle and the future its end sets."""
        loop = asyncio.get_running_loop()
        handle = next(_ids)
        if not self._queue:
            loop.call_soon(self.flush)
        self._queue.append((handle, copier, args, extra))
        self._state[handle] = None
        fut = self._wakes[handle] = loop.create_future()
        return handle, fut

    def flush(self) -> None:
        """Run every queued copy (each ends inside its post: they are small), then wake
        their pulls, all in this loop turn."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        self.flushes += 1
        try:
            for handle, copier, args, extra in queue:
                if handle not in self._state:
                    continue  # released before it ran: dropped
                self.copies += 1
                out = _run(copier, args, extra)
                self._state[handle] = (copier, out) if isinstance(out, int) and out is not True \
                    else out
        finally:  # every pull of the burst hears of its copy, whatever happened
            for handle, *_ in queue:
                if handle in self._state and self._state[handle] is None:
                    self._state[handle] = TransferError("the burst's copies stopped early")
                fut = self._wakes.pop(handle, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)

    def status(self, handle: int) -> XferStatus:
        st = self._state[handle]
        if st is None:
            return XferStatus(XferState.PENDING)
        if st is True:
            return XferStatus(XferState.DONE)
        if isinstance(st, TransferError):
            return XferStatus(XferState.FAILED, st)
        copier, real = st  # type: ignore[misc]  # went to the copy threads after all
        try:
            done = copier.poll(real)
            return XferStatus(XferState.DONE if done else XferState.PENDING)
        except TransferError as exc:
            return XferStatus(XferState.FAILED, exc)

    def wake(self, handle: int) -> asyncio.Future[None] | None:
        return self._wakes.get(handle)

    def release(self, handle: int) -> tuple[Copier, int] | None:
        """Forget ``handle``; (copier, its handle) when the copy went to the threads (the
        caller releases that), else None (queued: dropped; or ended)."""
        st = self._state.pop(handle, None)
        fut = self._wakes.pop(handle, None)
        if fut is not None and not fut.done():
            fut.cancel()
        if st is None or st is True or isinstance(st, TransferError):
            return None
        return st  # type: ignore[return-value]


def _run(copier: Copier, args: tuple[Any, ...], extra: dict[str, Any]) -> object:
    try:
        handle = copier.post(*args, **extra)
    except (KvdError, ValueError) as exc:
        return exc if isinstance(exc, TransferError) else TransferError(str(exc))
    except Exception as exc:  # noqa: BLE001 - one copy's bug fails its pull, not the burst
        return TransferError(f"local copy failed: {exc!r}")
    try:
        done = copier.poll(handle)
    except TransferError as exc:
        copier.release(handle)
        return exc
    if done:
        copier.release(handle)
        return True
    return handle

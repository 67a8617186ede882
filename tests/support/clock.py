"""The one fake clock of the test suites: virtual time that moves only when told.

It implements ``kvd.daemon.clock.Clock`` (``now``, ``sleep``, ``wait_for``,
``call_later``), so a
daemon built with it takes every lease, timeout and loop cadence from it: a test
moves through a 30 s lease in a few milliseconds of real time, and nothing
expires because the machine was slow. ``run()`` advances in small steps and gives
the event loop real time between them, so that messages between the test's
client and an in-process daemon are delivered as virtual time passes.

It is also callable (``clock()`` is ``clock.now()``) for code that takes a plain
``Callable[[], float]``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self._now = start_s
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        task = asyncio.ensure_future(aw)
        timer = asyncio.ensure_future(self.sleep(timeout_s))
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self._cancel_and_wait(task)  # like asyncio.wait_for: the inner task ends first
            raise
        finally:
            timer.cancel()
        if not task.done():
            await self._cancel_and_wait(task)
            raise TimeoutError(f"timed out after {timeout_s} s of fake time")
        return task.result()

    def call_later(self, seconds: float, fn: Callable[[], object]) -> asyncio.Future[None]:
        """A sleeper without a task: ``fn`` runs when time passes its deadline, unless the
        returned handle is cancelled first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        fut.add_done_callback(lambda f: None if f.cancelled() else fn())
        return fut

    @staticmethod
    async def _cancel_and_wait(task: asyncio.Future) -> None:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is being discarded
            pass

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has come."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def run(self, seconds: float, step_s: float = 0.01, real_step_s: float = 0.001
                  ) -> None:
        """Let ``seconds`` of virtual time pass in ``step_s`` steps, yielding real time
        (``real_step_s``) to the event loop after each so that I/O keeps flowing."""
        steps = max(1, round(seconds / step_s))
        for _ in range(steps):
            self.advance(seconds / steps)
            await asyncio.sleep(real_step_s)

    async def until(self, predicate, timeout_s: float = 10.0, step_s: float = 0.01,
                    what: str = "condition") -> None:
        """Run virtual time until ``predicate()`` (sync or async) holds, at most timeout_s."""
        waited = 0.0
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            if waited >= timeout_s:
                raise AssertionError(f"{what} not reached within {timeout_s} s of fake time")
            await self.run(step_s, step_s)
            waited += step_s


class VirtualLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on virtual time that jumps when idle: whenever nothing is
    ready to run, its clock moves straight to the next timer (trio's
    ``MockClock(autojump_threshold=0)``). Real code (kvd's `PullDriver`, whole tasks
    with their sleeps, timeouts and deadlines) runs unchanged on it, against in-memory
    fakes, through minutes of virtual time in milliseconds, the same way every run.

    Only for code whose every wait is a timer or a future the fakes resolve: a loop with
    nothing scheduled at all would wait forever, and raises instead."""

    def __init__(self, start_s: float = 1000.0) -> None:
        super().__init__()
        self._virtual_s = start_s
        selector = self._selector  # type: ignore[attr-defined]
        real_select = selector.select

        def select(timeout: float | None = None) -> list:
            ready = real_select(0)  # the loop's own wakeup pipe: never blocks
            if ready or timeout == 0:
                return ready
            if timeout is None:
                raise RuntimeError("virtual loop: nothing scheduled, it would wait forever")
            self._virtual_s += timeout
            return []

        selector.select = select

    def time(self) -> float:
        return self._virtual_s


class LoopClock:
    """``kvd.daemon.clock.Clock`` on the running loop's own time (a `VirtualLoop`'s)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        return await asyncio.wait_for(aw, timeout_s)

    def call_later(self, seconds: float, fn: Callable[[], object]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(seconds, fn)

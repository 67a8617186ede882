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
import collections
import contextvars
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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


class _Call:
    """A callback the loop runs once (soon, or at ``when``), unless cancelled first."""

    __slots__ = ("fn", "args", "ctx", "_cancelled", "_when")

    def __init__(self, fn: Callable[..., object], args: tuple, ctx: contextvars.Context | None,
                 when: float) -> None:
        self.fn, self.args, self.ctx, self._cancelled, self._when = fn, args, ctx, False, when

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled

    def when(self) -> float:
        return self._when


class VirtualLoop(asyncio.AbstractEventLoop):
    """An asyncio event loop on virtual time that jumps when idle: whenever nothing is
    ready to run, its clock moves straight to the next timer (trio's
    ``MockClock(autojump_threshold=0)``). Real code (kvd's `PullDriver`, whole tasks
    with their sleeps, timeouts and deadlines) runs unchanged on it, against in-memory
    fakes, through minutes of virtual time in milliseconds, the same way every run.

    No selector, no threads, no sockets: a ready queue and one heap of timers, which is
    all that code on virtual time waits on (a timer, or a future a fake resolves). That
    heap is also the fleet simulation's (tests/support/fleet): its network, transport and
    engines schedule on it beside the real drivers. An exception out of a plain callback
    (not a task's) propagates out of the run, as a broken invariant must.
    ``steps``: callbacks run so far."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now = start_s
        self._ready: collections.deque[_Call] = collections.deque()
        # (when, seq, fn, args, call): ``call`` None for `at`'s, which cannot be cancelled
        self._timers: list[tuple[float, int, Any, Any, _Call | None]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._running = False
        self._closed = False
        self.steps = 0
        self.errors: list[dict] = []  # what asyncio reported (a task destroyed pending, ...)

    def time(self) -> float:
        return self._now

    def get_debug(self) -> bool:
        return False

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._ready.clear()
        self._timers.clear()

    def stop(self) -> None:
        self._stopping = True

    def call_soon(self, callback: Callable[..., object], *args: object,
                  context: contextvars.Context | None = None) -> _Call:
        call = _Call(callback, args, context, self._now)
        self._ready.append(call)
        return call

    call_soon_threadsafe = call_soon

    def call_at(self, when: float, callback: Callable[..., object], *args: object,
                context: contextvars.Context | None = None) -> _Call:
        call = _Call(callback, args, context, when)
        heapq.heappush(self._timers, (when, next(self._seq), None, None, call))
        return call

    def at(self, when: float, callback: Callable[..., object], args: tuple) -> None:
        """`call_at` without a handle (nothing to cancel): the fleet simulation's events."""
        heapq.heappush(self._timers, (when, next(self._seq), callback, args, None))

    def call_later(self, delay: float, callback: Callable[..., object], *args: object,
                   context: contextvars.Context | None = None) -> _Call:
        return self.call_at(self._now + delay, callback, *args, context=context)

    def create_future(self) -> asyncio.Future:
        return asyncio.Future(loop=self)

    def create_task(self, coro, *, name: str | None = None,  # type: ignore[override]
                    context: contextvars.Context | None = None) -> asyncio.Task:
        return asyncio.Task(coro, loop=self, name=name, context=context)

    def call_exception_handler(self, context: dict) -> None:
        self.errors.append(context)

    def default_exception_handler(self, context: dict) -> None:
        self.errors.append(context)

    def run_until(self, until_s: float) -> None:
        """Run every callback due up to ``until_s`` (or until `stop`); time is then
        ``until_s``, unless stopped earlier."""
        self._run(until_s)
        if not self._stopping and self._now < until_s:
            self._now = until_s
        self._stopping = False

    def run_forever(self) -> None:
        self._run(None)
        self._stopping = False

    def run_until_complete(self, future):  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(future, loop=self)
        task.add_done_callback(lambda _: self.stop())
        self.run_forever()
        if not task.done():
            raise RuntimeError("virtual loop stopped before the future completed")
        return task.result()

    def _run(self, until_s: float | None) -> None:
        old = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        self._running = True
        ready, timers, pop = self._ready, self._timers, heapq.heappop
        try:
            while not self._stopping:
                if ready:
                    call = ready.popleft()
                else:
                    if not timers:
                        if until_s is None:
                            raise RuntimeError("virtual loop: nothing scheduled, it would "
                                               "wait forever")
                        return
                    if until_s is not None and timers[0][0] > until_s:
                        return
                    when, _, fn, args, call = pop(timers)
                    if when > self._now:
                        self._now = when
                    if call is None:
                        self.steps += 1
                        fn(*args)
                        continue
                if call._cancelled:
                    continue
                self.steps += 1
                if call.ctx is None:
                    call.fn(*call.args)
                else:
                    call.ctx.run(call.fn, *call.args)
        finally:
            self._running = False
            asyncio.events._set_running_loop(old)


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

"""The daemon's loop is never held by a registration, and its lag is measured.

Fast, in-process checks of the logic behind tests/daemon/test_engine_face_heavy.py (which
measures real ``kvd serve`` processes): the loop-lag watcher records how late the loop
ran, a registration that takes long leaves the engine face answering others, and one
cancelled midway (the daemon stopping) leaves no pool and no NIXL registration behind.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from support.clock import FakeClock
from support.inprocess import daemon_pair, run

from kvd.daemon.clock import MonotonicClock
from kvd.daemon.looplag import watch_loop_lag
from kvd.tools.sim import EngineShape, layout_spec
from kvd.transport.loopback import LoopbackTransport
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="lag", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, num_blocks=8)
SLOW_REGISTER_S = 1.0


class Recorder:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, amount: float) -> None:
        self.values.append(amount)


def test_loop_lag_records_how_late_the_loop_woke_and_how_long_it_was_held(caplog) -> None:
    async def body() -> None:
        clock, lag, held = FakeClock(), Recorder(), Recorder()
        waited = [0.0]  # the loop thread's run delay: time it waited for a CPU
        task = asyncio.ensure_future(watch_loop_lag(clock, lag, held, interval_s=0.01,
                                                    run_delay_s=lambda: waited[0]))
        await asyncio.sleep(0)
        clock.advance(0.01)  # on time
        await asyncio.sleep(0)
        waited[0] = 0.1  # of the next 0.3 s of lateness, 0.1 s waiting for a CPU
        clock.advance(0.31)  # asked to wake at +0.01, woke at +0.31: late 0.3 s
        await asyncio.sleep(0)
        waited[0] = 0.4  # late 0.3 s more, all of it the host's
        clock.advance(0.31)
        await asyncio.sleep(0)
        task.cancel()
        assert lag.values[0] == 0.0 and held.values[0] == 0.0
        assert abs(lag.values[1] - 0.3) < 1e-9 and abs(held.values[1] - 0.2) < 1e-9
        assert abs(lag.values[2] - 0.3) < 1e-9 and held.values[2] == 0.0

    with caplog.at_level(logging.WARNING, logger="kvd.daemon"):
        run(body())
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1 and "stalled 300 ms, held by the daemon 200 ms" in stalls[0]


def test_loop_lag_sees_a_callback_that_holds_the_real_loop() -> None:
    """A blocking call on the loop (here a sleep: no CPU used, not waiting for one) is
    held time; the thread's real run delay is read from /proc (schedstat)."""
    async def body() -> None:
        lag, held = Recorder(), Recorder()
        task = asyncio.ensure_future(watch_loop_lag(MonotonicClock(), lag, held,
                                                    interval_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # a blocking call on the loop: what the watcher exists to see
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0)
        assert max(lag.values) >= 0.15, lag.values
        assert max(held.values) >= 0.15, held.values
        assert sorted(lag.values)[len(lag.values) // 2] < 0.05  # otherwise on time

    run(body())


class SlowRegistration(LoopbackTransport):
    """NIXL registration that takes SLOW_REGISTER_S on the NIXL thread (as registering
    a large pool can), unless ``fast``."""

    started: threading.Event

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        if getattr(self, "slow", False):
            self.started.set()
            time.sleep(SLOW_REGISTER_S)
        return super().register(addr, nbytes, mem_type, device_id)


def test_a_slow_registration_leaves_the_engine_face_answering() -> None:
    """Before: the face awaited each handler, so every Ping and Poll of every engine
    waited for the registration (pool allocation, NIXL registration) to finish."""
    async def body() -> None:
        async with daemon_pair(SlowRegistration) as p:
            await p.dc.register("other", MODEL, layout_spec(SHAPE))
            transport = p.decode.datapath.transport
            transport.started, transport.slow = threading.Event(), True
            registering = asyncio.ensure_future(p.dc.register("big", MODEL, layout_spec(SHAPE)))
            while not transport.started.is_set():
                await asyncio.sleep(0.005)
            rtts = []
            for _ in range(5):
                t0 = time.perf_counter()
                await p.dc.call(P.Ping(engine_id="other", tp_rank=0))
                await p.dc.poll("other", timeout_s=0.0)
                rtts.append(time.perf_counter() - t0)
            assert not registering.done(), "the registration should still be under way"
            assert max(rtts) < SLOW_REGISTER_S / 4, rtts
            handle = await registering  # answered when done, to the right call
            assert handle.engine_id == "big" and handle.pool.array.nbytes > 0
            transport.slow = False

    run(body())


def test_a_registration_cancelled_midway_leaves_no_pool_and_no_registration() -> None:
    """The daemon stops while a registration is on the NIXL thread: once that ends, the
    pool is deregistered and freed (daemon_pair checks no pool file is left)."""
    async def body() -> None:
        async with daemon_pair(SlowRegistration) as p:
            transport = p.decode.datapath.transport
            transport.started, transport.slow = threading.Event(), True
            registering = asyncio.ensure_future(p.dc.register("big", MODEL, layout_spec(SHAPE)))
            while not transport.started.is_set():
                await asyncio.sleep(0.005)
            await p.decode.stop()
            assert p.decode.shutdown_counts.registrations == 0
            registering.cancel()
            p.decode.stop = _already_stopped  # daemon_pair stops it again at the end

    run(body())


async def _already_stopped() -> None:
    return None

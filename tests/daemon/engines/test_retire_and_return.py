"""A stall of the daemon never retires a live engine, and an engine retired while it lived
on takes its pool back when it registers again, without an engine restart.

In-process daemons on the fake clock: a stall is one jump of the clock longer than the
housekeeping cadence (the daemon could not run, the engine's pings waited in its
socket); an engine frozen past ``engine_timeout_s`` is the clock running in small steps
with no pings. Whole processes (SIGSTOP of the daemon, of the engine, of both) are in
tests/daemon/engines/test_stall_processes.py.
"""

from __future__ import annotations

import asyncio

import pytest
from support.inprocess import daemon_pair, run

from kvd.client import AsyncKvdClient
from kvd.errors import NotFoundError
from kvd.pool.shm import kvd_segments
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="ret", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, num_blocks=8)
TIMEOUT_S = 30.0  # the default engine_timeout_s


def _client(address: str) -> AsyncKvdClient:
    return AsyncKvdClient(address, timeout_s=5, ping_interval_s=0)


def test_a_stall_of_the_daemon_longer_than_the_engine_timeout_retires_nobody() -> None:
    async def body() -> None:
        async with daemon_pair(pool_backing="shm") as p:
            c = _client(p.prefill.cfg.engine_address)
            try:
                await c.register("eng", MODEL, layout_spec(SHAPE))
                await p.clock.run(TIMEOUT_S / 2, step_s=0.5)  # quiet, no pings: 15 s
                p.clock.advance(41.0)  # the daemon's loop waited 41 s for a CPU
                await p.clock.run(0.2)  # housekeeping runs: the stall is seen
                status = (await c.status()).engines
                assert [(e.engine_id, e.gone) for e in status] == [("eng", False)]
                await c.ping()  # still registered
                await p.clock.run(TIMEOUT_S + 1.0, step_s=0.5)  # silent on its own now
                assert all(e.gone for e in (await c.status()).engines)
            finally:
                c.close()

    run(body())


def test_an_engine_retired_while_it_lived_on_takes_its_pool_back() -> None:
    async def body() -> None:
        async with daemon_pair(pool_backing="shm") as p:
            c = _client(p.prefill.cfg.engine_address)
            try:
                h = await c.register("eng", MODEL, layout_spec(SHAPE))
                h.kv.reshape(-1)[:64] = 7  # the engine's KV, in the daemon's pool
                name = h.pool.handle.name
                await p.clock.run(TIMEOUT_S + 1.0, step_s=0.5)  # frozen engine: no pings
                with pytest.raises(NotFoundError, match="not registered"):
                    await c.ping()
                await p.clock.run(1.0)  # housekeeping: the pool is kept (still mapped)
                assert name in kvd_segments(p.prefix)
                again = await c.adopt_rank(h)
                assert again.pool.handle.name == name and again.pool is h.pool
                assert (again.kv.reshape(-1)[:64] == 7).all()
                await c.ping()
                status = await c.status()
                assert [(e.engine_id, e.gone) for e in status.engines] == [("eng", False)]
                # P/D works again: it can publish (and the pool stays one pool).
                await c.publish("eng", "r1", [1, 2])
                await c.deregister(again)
                await p.clock.until(lambda: name not in kvd_segments(p.prefix),
                                    what="the pool freed once the engine deregistered")
            finally:
                c.close()

    run(body())


def test_a_retired_engine_that_no_longer_maps_its_pool_has_it_freed() -> None:
    async def body() -> None:
        async with daemon_pair(pool_backing="shm") as p:
            c = _client(p.prefill.cfg.engine_address)
            try:
                h = await c.register("eng", MODEL, layout_spec(SHAPE))
                name = h.pool.handle.name
                await p.clock.run(TIMEOUT_S + 1.0, step_s=0.5)
                await asyncio.sleep(0)
                h.pool.close()  # the engine unmapped it (gone for good)
                await p.clock.until(lambda: name not in kvd_segments(p.prefix),
                                    what="the pool freed once nobody maps it")
            finally:
                c.close()

    run(body())

"""Daemons in the test process: LoopbackTransport, the fake clock, asyncio clients.

``daemon_pair()`` is the one pair fixture of the in-process tests: a prefill
and a decode daemon sharing one FakeClock, each with an AsyncKvdClient, stopped
at the end with the check that every pool was freed.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from kvd.client import AsyncKvdClient, RankHandle
from kvd.config import Config
from kvd.daemon.server import Daemon
from kvd.pool.shm import kvd_segments
from kvd.tools.localcluster import free_port
from kvd.tools.sim import EngineShape, layout_spec
from kvd.transport.base import Transport
from kvd.transport.loopback import LoopbackTransport
from kvd.wire import protocol as P
from support.clock import FakeClock

MODEL = P.ModelSpec(name="inproc", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=16)


async def register(client: AsyncKvdClient, engine_id: str, shape: EngineShape = SHAPE,
                   tp_rank: int = 0) -> RankHandle:
    """Register one rank of MODEL on ``client``'s daemon, a pool of ``shape``."""
    return await client.register(engine_id, MODEL, layout_spec(shape), tp_rank, shape.tp_size)


def config(prefix: str, **overrides: Any) -> Config:
    # host_pulls off: a pair stands for two nodes (its fake transport between them)
    settings = {"lease_s": 5.0, "heartbeat_interval_s": 1.0, "handshake_timeout_s": 2.0,
                "host_pulls": False, **overrides}
    return Config(engine_address=f"tcp://127.0.0.1:{free_port()}",
                  peer_address=f"tcp://127.0.0.1:{free_port()}", metrics_port=0,
                  shm_prefix=prefix, **settings)


def sample(d: Daemon, name: str, **labels: str) -> float:
    return d.metrics.registry.get_sample_value(name, labels or None) or 0.0


@dataclass
class Pair:
    prefill: Daemon
    decode: Daemon
    pc: AsyncKvdClient
    dc: AsyncKvdClient
    clock: FakeClock
    prefix: str


async def start_daemon(prefix: str, clock: FakeClock,
                       transport: Callable[[], Transport] = LoopbackTransport,
                       cfg: Config | None = None, **overrides: Any) -> Daemon:
    """A daemon on the fake clock; ``cfg`` to restart one on the same addresses."""
    d = Daemon(cfg or config(prefix, **overrides), transport_factory=transport, clock=clock)
    await d.start()
    return d


@asynccontextmanager
async def daemon_pair(transport: Callable[[], Transport] = LoopbackTransport,
                      **overrides: Any) -> AsyncIterator[Pair]:
    clock = FakeClock()
    prefix = f"kvd-unit-{uuid.uuid4().hex[:8]}"
    prefill = await start_daemon(prefix, clock, transport, **overrides)
    decode = await start_daemon(prefix, clock, transport, **overrides)
    pc = AsyncKvdClient(prefill.cfg.engine_address, timeout_s=5, ping_interval_s=0)
    dc = AsyncKvdClient(decode.cfg.engine_address, timeout_s=5, ping_interval_s=0)
    pair = Pair(prefill, decode, pc, dc, clock, prefix)
    try:
        yield pair  # a test may replace pair.prefill / pair.decode (a restart)
    finally:
        pair.pc.close()
        pair.dc.close()
        await pair.prefill.stop()
        await pair.decode.stop()
    assert kvd_segments(prefix) == [], "stop() must free every pool"


_stash: weakref.WeakKeyDictionary[AsyncKvdClient, list[tuple[str, P.Event]]] = (
    weakref.WeakKeyDictionary())


async def wait_event(client: AsyncKvdClient, clock: FakeClock, engine_id: str, request_id: str,
                     kind: str, fake_s: float = 10.0) -> P.Event:
    """Poll (timeout 0) while fake time runs, until that event arrives; other events are
    kept for later calls."""
    kept = _stash.setdefault(client, [])
    waited = 0.0
    while waited < fake_s:
        kept.extend((engine_id, ev) for ev in await client.poll(engine_id, timeout_s=0.0))
        for item in kept:
            eng, ev = item
            if eng == engine_id and ev.request_id == request_id and ev.kind == kind:
                kept.remove(item)
                return ev
        await clock.run(0.05, step_s=0.005)
        waited += 0.05
    raise AssertionError(f"no {kind} for {request_id} within {fake_s} s of fake time")


async def until(clock: FakeClock, predicate: Callable[[], Any], what: str,
                fake_s: float = 5.0) -> None:
    await clock.until(predicate, timeout_s=fake_s, what=what)


def run(coro: Any) -> None:
    asyncio.run(coro)

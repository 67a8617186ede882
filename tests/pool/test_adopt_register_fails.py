"""An adoption whose NIXL registration fails gives the engine's pool file back.

Adopting renames the dead incarnation's file into the new owner's namespace; if the
registration then failed, the daemon used to close the pool like one of its own, which
deletes the file: the engine kept its mapping but lost the name it can be adopted by,
so its KV transfers stayed off until the engine restarted."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clock import FakeClock
from support.inprocess import start_daemon
from support.standin import scratch_shm_dir, start_standin

from kvd.client import AsyncKvdClient
from kvd.daemon.engines.table import resolve_registration, validate_registration
from kvd.errors import KvdError, TransferError
from kvd.pool.mapping import map_pool
from kvd.tools.sim import EngineShape, layout_spec
from kvd.transport.loopback import LoopbackTransport
from kvd.wire import protocol as P

PREFIX = "kvd-adoptfail"
MODEL = P.ModelSpec(name="adopt", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, num_blocks=8)

class FailingRegistration(LoopbackTransport):
    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        raise TransferError("registerMem: injected failure")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with scratch_shm_dir(PREFIX) as d:
        yield d


def test_failed_registration_gives_the_adopted_pool_back(shm_dir: Path) -> None:
    msg = P.RegisterEngine(engine_id="e", model=MODEL, layout=layout_spec(SHAPE), tp_rank=0,
                           tp_size=1)
    _, cache, _ = validate_registration(resolve_registration(msg))
    nbytes = cache.total_nbytes
    dead, _, (name,) = start_standin(shm_dir, PREFIX, nbytes, count=1)
    kept = P.PoolHandle(kind="shm", name=name, nbytes=nbytes, shape=[nbytes], dtype="uint8",
                        directory=str(shm_dir))
    engine = map_pool(kept)  # the live engine's mapping (its flock keeps the file)
    dead.kill()
    dead.wait(10)

    async def adopt(transport: type[LoopbackTransport]) -> P.Registered | KvdError:
        d = await start_daemon(PREFIX, FakeClock(), transport, shm_dir=str(shm_dir))
        c = AsyncKvdClient(d.cfg.engine_address, timeout_s=5, ping_interval_s=0)
        try:
            return await c.call(P.RegisterEngine(engine_id="e", model=MODEL, tp_rank=0, tp_size=1,
                                                 layout=layout_spec(SHAPE), adopt_pool=kept))
        except KvdError as exc:
            return exc
        finally:
            c.close()
            await d.stop()

    try:
        failed = asyncio.run(adopt(FailingRegistration))
        assert isinstance(failed, KvdError) and "injected" in str(failed)
        assert name in os.listdir(shm_dir), "the engine's pool file was deleted"
        assert engine.array[:4].tolist() == [1, 2, 3, 4]
        # The engine may ask again, and a daemon that can register takes the pool over.
        ok = asyncio.run(adopt(LoopbackTransport))
        assert isinstance(ok, P.Registered), ok
        assert ok.pool.name != name and ok.pool.nbytes == nbytes
    finally:
        engine.close()
        if dead.poll() is None:
            dead.kill()
            dead.wait()

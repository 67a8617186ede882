"""An engine whose connections to kvd all close is gone at once (not engine_timeout_s
later); other engines, and clients that only ask for status, are not touched."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from pathlib import Path

from support.clock import FakeClock
from support.inprocess import config, daemon_pair, register, run, start_daemon

from kvd.client import AsyncKvdClient
from kvd.config import Config
from kvd.daemon.engines.liveness import ConnectionTracker


def _live(status_engines: list) -> set[str]:
    return {e.engine_id for e in status_engines if not e.gone}


def test_a_vanished_engine_is_retired_within_fake_milliseconds() -> None:
    async def body() -> None:
        async with daemon_pair() as p:
            gone = AsyncKvdClient(p.prefill.cfg.engine_address, timeout_s=5, ping_interval_s=0)
            await register(gone, "vanishing")
            await register(p.pc, "staying")
            looker = AsyncKvdClient(p.prefill.cfg.engine_address, timeout_s=5,
                                    ping_interval_s=0)
            await looker.status()
            looker.close()  # a `kvd status`: no engine of its own
            gone.close()  # no Deregister: as if the process were killed
            t0 = p.clock.now()
            for _ in range(100):
                await asyncio.sleep(0.02)
                await p.clock.run(0.01)
                if "vanishing" not in _live((await p.pc.status()).engines):
                    break
            live = _live((await p.pc.status()).engines)
            assert live == {"staying"}, live
            assert p.clock.now() - t0 < p.prefill.cfg.engine_timeout_s / 10

    run(body())


def test_a_vanished_engine_over_ipc_is_retired(tmp_path: Path) -> None:
    """ipc connections are keyed by the peer's pid (SO_PEERCRED)."""

    async def body() -> None:
        clock = FakeClock()
        cfg = config("kvd-unit-ipc")
        cfg = Config(**{**cfg.__dict__, "engine_address": f"ipc://{tmp_path}/engine.sock"})
        daemon = await start_daemon("kvd-unit-ipc", clock, cfg=cfg)
        staying = AsyncKvdClient(cfg.engine_address, timeout_s=5, ping_interval_s=0)
        gone = AsyncKvdClient(cfg.engine_address, timeout_s=5, ping_interval_s=0)
        try:
            await register(staying, "staying")
            await register(gone, "vanishing")
            gone.close()
            for _ in range(100):
                await asyncio.sleep(0.02)
                await clock.run(0.01)
                if "vanishing" not in _live((await staying.status()).engines):
                    break
            assert _live((await staying.status()).engines) == {"staying"}
        finally:
            await staying.aclose()
            await daemon.stop()

    run(body())


def test_tracker_tells_a_reused_descriptor_from_the_same_connection() -> None:
    keys: dict[int, Hashable | None] = {7: ("tcp", 5001), 8: ("tcp", 5002)}
    tracker = ConnectionTracker(key_of=keys.get)
    tracker.note(b"a", 7, "e1")
    tracker.note(b"b", 8, "e1")  # e1 speaks over two connections
    tracker.note(b"c", 8, "e2")
    assert tracker.closed(7) == []  # fd 7 still holds a's connection: a report for another
    keys[7] = ("tcp", 6000)  # a's connection closed, fd 7 reused by someone else
    assert tracker.closed(7) == []  # e1 still has b
    keys[8] = None
    assert sorted(tracker.closed(8)) == ["e1", "e2"]


def test_tracker_ignores_unreadable_connections_and_forgets_gone_engines() -> None:
    keys: dict[int, Hashable | None] = {3: None, 4: ("unix", 42)}
    tracker = ConnectionTracker(key_of=keys.get)
    tracker.note(b"x", 3, "e1")  # key unknown: never tracked, so never retired early
    tracker.note(b"y", 4, "e2")
    tracker.forget("e2")  # deregistered meanwhile
    keys[4] = None
    assert tracker.closed(3) == [] and tracker.closed(4) == []

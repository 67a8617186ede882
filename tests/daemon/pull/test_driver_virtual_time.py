"""The real `PullDriver` (and its machine) on virtual time, against in-memory fakes.

`VirtualLoop` (tests/support/clock.py) is an asyncio loop whose clock jumps to the next
timer whenever nothing is ready: the driver's own task, sleeps, heartbeats, deadline and
quarantine run unchanged, through a minute of virtual time in milliseconds. The fakes
(`Fake*`) stand for what the driver touches: the producer's daemons (`FakePeers`: each
message answered after a network delay), the transfers (`FakeMover`), the engine, the
services. No hand copy of the driver: whatever it does wrong shows here. The fleet
simulation (tests/support/fleet) runs the same driver on the same loop, its fakes over a
simulated network and transport; these are the scripted ones, for one pull at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from support.clock import LoopClock, VirtualLoop
from support.fleet.fakes import FakeMetrics

from kvd.config import Config
from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.driver import PullDriver
from kvd.daemon.pull.machine import Pull
from kvd.daemon.pull.quarantine import QuarantineCounts
from kvd.daemon.pull.state import Path, PullState
from kvd.errors import TransferError
from kvd.planner import Parallelism
from kvd.planner.assembly import ProducerReads
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from kvd.wire import protocol as P

ADDR = "tcp://producer:1"
AGENT = "agent-p"
NET_S = 0.0005  # one way, each message
READ_S = 0.002  # a READ's time, unless held
HEARTBEAT_S = 0.5


class FakeRank:
    def __init__(self) -> None:
        self.pins = 0


class FakeEngine:
    def __init__(self) -> None:
        self.engine_id = "dec"
        self.par = Parallelism(1, 1)
        self.mem_type = "DRAM"
        self.ranks = [FakeRank()]

    def live_ranks(self) -> list[FakeRank]:
        return self.ranks


class FakePeers:
    """The producer's daemon, answering after a network delay: the Acquire with
    ``acquired``, heartbeats with its incarnation (``instance``, changeable meanwhile)."""

    def __init__(self, acquired: P.Acquired) -> None:
        self.acquired = acquired
        self.instance = "inst-a"
        self.conns: dict[str, Any] = {}
        self.sent: list[tuple[float, object]] = []

    def send(self, address: str, msg: object, timeout_s: float | None = None
             ) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        self.sent.append((loop.time(), msg))
        fut: asyncio.Future[Reply] = loop.create_future()
        if isinstance(msg, P.Acquire):
            body: object = self.acquired
        elif isinstance(msg, P.Heartbeat):
            body = P.HeartbeatAck(unknown=[])
        else:  # notices, abandons
            body = None
        loop.call_later(2 * NET_S, lambda: fut.done() or fut.set_result(
            Reply(body, self.instance, loop.time())))
        return fut

    async def request(self, address: str, msg: object, timeout_s: float | None = None
                      ) -> Reply:
        return await self.send(address, msg, timeout_s)

    def take_ready(self, addresses: Iterable[str]) -> None:
        pass

    def drop_address(self, address: str, why: str) -> None:
        pass

    def forget(self, local_engine: str, remote_engine: str) -> None:
        pass

    def count(self, kind: type) -> int:
        return sum(isinstance(m, kind) for _, m in self.sent)


class FakeMover:
    """Transfers that end READ_S after their post, or when ``held`` is cleared (or
    severed: they fail)."""

    path = Path.REMOTE

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.ends: dict[int, float | None] = {}  # handle -> when it ends (None: held)
        self.severed: set[int] = set()
        self.posted = 0
        self.held = False
        self.fail_with: TransferError | None = None

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        return True

    def post_now(self, posts: list[ReadPost]) -> list[PostResult] | None:
        now = asyncio.get_running_loop().time()
        self.posted += 1
        out = []
        for _ in posts:
            x = next(self.ids)
            self.ends[x] = None if self.held else now + READ_S
            out.append(PostResult(x, False))
        return out

    async def post(self, posts: list[ReadPost]) -> list[PostResult]:
        return self.post_now(posts) or []

    async def poll(self, handles: list[int]) -> dict[int, XferStatus]:
        now = asyncio.get_running_loop().time()
        out = {}
        for x in handles:
            end = self.ends[x]
            if x in self.severed:
                out[x] = XferStatus(XferState.FAILED, TransferError("severed"))
            elif end is not None and now >= end:
                out[x] = (XferStatus(XferState.FAILED, self.fail_with) if self.fail_with
                          else XferStatus(XferState.DONE))
            else:
                out[x] = XferStatus(XferState.PENDING)
        return out

    def unhold(self) -> None:
        now = asyncio.get_running_loop().time()
        self.ends = {x: now if e is None else e for x, e in self.ends.items()}

    async def release(self, handles: list[int]) -> None:
        pass

    async def sever(self, producers: Mapping[str, tuple[str, ...]]) -> None:
        self.severed.update(self.ends)

    def close(self) -> None:
        pass


def _assemble(pull: Pull, engine: FakeEngine, remote: RemoteEngine) -> dict[str, ProducerReads]:
    reads = ProducerReads(owner=AGENT, reads=1)
    n = len(pull.msg.local_block_ids)
    reads.add(np.arange(n, dtype=np.int64) * 4096, np.arange(n, dtype=np.int64) * 4096,
              np.full(n, 4096, dtype=np.int64), 0, 0)
    return {AGENT: reads}


class Run:
    """One pull driven by the real PullDriver on a VirtualLoop."""

    def __init__(self, acquired: P.Acquired, **cfg: Any) -> None:
        self.cfg = Config(engine_address="tcp://127.0.0.1:1", peer_address="tcp://127.0.0.1:2",
                          metrics_port=0, heartbeat_interval_s=HEARTBEAT_S, **cfg)
        self.peers = FakePeers(acquired)
        self.mover = FakeMover()
        self.engine = FakeEngine()
        self.events: list[P.Event] = []
        self.tasks: list[asyncio.Task[Any]] = []

    async def pull(self, hook: Callable[[Run], Any] | None = None) -> P.Event:
        loop = asyncio.get_running_loop()
        metrics = FakeMetrics()

        def spawn(coro: Any) -> asyncio.Task[Any]:
            task = loop.create_task(coro)
            self.tasks.append(task)
            return task

        svc = SimpleNamespace(
            cfg=self.cfg, clock=LoopClock(), metrics=metrics, spawn=spawn,
            events=SimpleNamespace(push=lambda _e, ev: self.events.append(ev),
                                   answer=lambda *a: self.events.append(a[-1])),
            registry=SimpleNamespace(complete=self._complete), datapath=None)
        msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                     remote_address=ADDR, remote_block_ids=[1, 2], local_block_ids=[5, 6])
        self.pull_ = Pull(msg=msg, started_s=loop.time(), path=Path.REMOTE,
                          liveness_timeout_s=self.cfg.peer_liveness_timeout_s,
                          transfer_timeout_s=self.cfg.transfer_timeout_s)
        remote = RemoteEngine(desc=SimpleNamespace(mem_type="DRAM"),  # type: ignore[arg-type]
                              daemons={ADDR: RemoteDaemon(ADDR, AGENT, "inst-a", 1)})
        done = loop.create_future()
        driver = PullDriver(svc, self.pull_, self.mover, self.peers,  # type: ignore[arg-type]
                            QuarantineCounts(self.cfg, metrics), _assemble,  # type: ignore[arg-type]
                            lambda p: done.set_result(None))
        if not driver.run_now(self.engine, remote):  # type: ignore[arg-type]
            driver.task = spawn(driver.run())
        if hook is not None:
            await hook(self)
        await done
        for task in self.tasks:
            task.cancel()
        (event,) = self.events
        assert self.engine.ranks[0].pins == 0, "pools left pinned"
        return event

    async def _complete(self, engine_id: str, timeout_s: float) -> FakeEngine:
        return self.engine


def _go(run: Run, hook: Callable[[Run], Any] | None = None) -> tuple[P.Event, float]:
    loop = VirtualLoop()
    try:
        t0 = loop.time()
        event = loop.run_until_complete(run.pull(hook))
        return event, loop.time() - t0
    finally:
        loop.close()


def _held(s: float) -> P.Acquired:
    return P.Acquired(epoch=1, held_s=s, hold_id=7)


def test_a_small_pull_ends_ok_in_the_real_driver() -> None:
    run = Run(_held(100.0))
    event, took_s = _go(run)
    assert event.ok and event.nbytes == 2 * 4096 and run.pull_.state is PullState.DONE
    assert run.mover.posted == 1 and took_s < 0.01


def test_a_read_again_keeps_the_leases_alive_on_virtual_time() -> None:
    """The first READ may predate the publish (a hold younger than the READ): it must end
    before the same READs go again, heartbeats renewing the lease meanwhile (20 s here)."""
    run = Run(_held(0.0))
    run.mover.held = True

    async def hook(r: Run) -> None:
        await asyncio.sleep(20.0)
        assert r.pull_.state is PullState.DISCARDING
        r.mover.held = False
        r.mover.unhold()

    event, took_s = _go(run, hook)
    assert event.ok and run.mover.posted == 2
    beats = run.peers.count(P.Heartbeat)
    assert 20.0 / HEARTBEAT_S - 2 <= beats <= 20.0 / HEARTBEAT_S + 2, beats
    assert 20.0 <= took_s < 20.1


def test_the_deadline_quarantines_then_severs_then_reports_once() -> None:
    run = Run(_held(100.0), transfer_timeout_s=60.0)
    run.mover.held = True  # the READ never ends by itself
    seen: list[str] = []

    async def hook(r: Run) -> None:
        await asyncio.sleep(59.0)
        seen.append(r.pull_.state.value)

    event, took_s = _go(run, hook)
    assert seen == ["reading"]
    assert not event.ok and event.error.startswith("timeout")
    assert event.invalid_block_ids == [5, 6] and run.mover.severed
    assert 60.0 <= took_s < 60.2
    assert run.peers.count(P.Abandon) == 1  # the producer stops holding it for us


@pytest.mark.parametrize("restarted", [True, False])
def test_a_failed_read_is_probed_in_the_real_driver(restarted: bool) -> None:
    """The READ fails after the Acquire's reply came: the producer daemon is asked which
    incarnation it is; restarted meanwhile, the pull fails peer_lost, else with the
    transfer's own error."""
    run = Run(_held(100.0))
    run.mover.fail_with = TransferError("nixlRemoteDisconnectError")

    async def hook(r: Run) -> None:
        await asyncio.sleep(READ_S * 0.75)  # the reply is in, the READ not ended yet
        assert r.pull_.replies is not None
        if restarted:
            r.peers.instance = "inst-b"

    event, _ = _go(run, hook)
    assert not event.ok and event.invalid_block_ids == [5, 6]
    if restarted:
        assert event.error.startswith("peer_lost") and "restarted" in event.error, event.error
    else:
        assert event.error == "transfer_failed: nixlRemoteDisconnectError", event.error
    assert run.peers.count(P.Heartbeat) == 1  # the probe


def test_a_bug_in_the_real_driver_shows_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hand copy in between: a driver that forgets to renew the leases while a READ is
    discarded sends no heartbeat through those 20 s (the producer's hold would lapse)."""

    async def no_beat(self: PullDriver) -> None:
        return None

    monkeypatch.setattr(PullDriver, "_beat", no_beat)
    run = Run(_held(0.0))
    run.mover.held = True

    async def hook(r: Run) -> None:
        await asyncio.sleep(20.0)
        r.mover.held = False
        r.mover.unhold()

    event, _ = _go(run, hook)
    assert event.ok and run.peers.count(P.Heartbeat) == 0

"""The real `ProgressiveRunner` on virtual time, against in-memory fakes: the registration
whose blocks a progressive pull fills is the one it reads into, or it reads nothing; a
pull past its hold timeout that waits for its range in flight waits, without spinning.
Both found by the fleet simulation (tests/support/fleet/progressive.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from types import SimpleNamespace
from typing import Any, TypeVar

from support.clock import LoopClock, VirtualLoop

from kvd.config import Config
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.progressive import Progressive, ProgressiveRunner, ProgState
from kvd.wire import protocol as P

ADDR = "tcp://producer:1"
T = TypeVar("T")


class SealedPeers:
    """The producer's daemon: the first Watch answered at once with ``sealed``, the next
    ones never (the request sealed no further); an Abandon taken."""

    def __init__(self, sealed: P.Sealed) -> None:
        self.sealed = sealed
        self.watches = 0

    async def request(self, address: str, msg: object, timeout_s: float | None = None
                      ) -> Reply:
        if isinstance(msg, P.Watch):
            self.watches += 1
            if self.watches > 1:
                await asyncio.get_running_loop().create_future()
            return Reply(self.sealed, "p.1", 0.0)
        return Reply(P.Ok(), "p.1", 0.0)


class CountingClock(LoopClock):
    """The loop's clock; a runner that waits more than ``max_waits`` times spins."""

    def __init__(self, max_waits: int) -> None:
        self.waits, self.max_waits = 0, max_waits

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        self.waits += 1
        if self.waits > self.max_waits:
            raise RuntimeError(f"the runner waited {self.waits} times: it spins")
        return await super().wait_for(aw, timeout_s)


def pull_msg() -> P.Pull:
    return P.Pull(engine_id="dec", request_id="r", remote_engine_id="pre", remote_address=ADDR,
                  remote_block_ids=[], local_block_ids=[1, 2], num_tokens=8, progressive=True)


def test_a_range_is_never_read_into_a_registration_the_pull_did_not_start_with() -> None:
    """Found by the fleet simulation (seed 40 of Knobs(prog_ops=10)): the decode engine
    left and registered again (a new pool) while its progressive pull waited for seals;
    the runner then started its ranges as pulls of the new registration, whose READs
    wrote into blocks the new engine had never given it."""
    loop = VirtualLoop()
    old, new = object(), object()
    registry = SimpleNamespace(engines={"dec": new})  # `old` left, `new` registered since
    svc = SimpleNamespace(clock=LoopClock(), cfg=Config(), registry=registry,
                          spawn=loop.create_task)
    msg = pull_msg()
    started: list[P.Pull] = []
    reports: list[P.Event] = []

    async def main() -> Any:
        prog = Progressive(msg=msg, local_block_tokens=4, started_s=loop.time(),
                           hold_timeout_s=5.0)
        sealed = P.Sealed(state="complete", generation=0, num_tokens=8, block_ids=[5, 6],
                          block_size_tokens=4)
        runner = ProgressiveRunner(prog, SealedPeers(sealed), svc, old,
                                   lambda child, answer: started.append(child),
                                   lambda p, event: reports.append(event))
        await asyncio.wait_for(runner.run(), 10.0)
        return prog

    prog = loop.run_until_complete(main())
    assert started == []
    assert prog.state is ProgState.FAILED and "registered again" in prog.error
    (event,) = reports
    assert not event.ok and event.invalid_block_ids == [1, 2]


def test_past_its_hold_timeout_a_pull_waits_for_its_range_without_spinning() -> None:
    """Seed 125 of Knobs(prog_ops=10): its range in flight, a pull timed out (no seal within
    the hold timeout) and must wait for that range to end before it reports. Its runner
    then woke at once, again and again (a wait of 0 s for a deadline already passed):
    virtual time stood still, and a real daemon's loop would spin until the range ended."""
    loop = VirtualLoop()
    engine = object()
    clock = CountingClock(max_waits=50)
    svc = SimpleNamespace(clock=clock, cfg=Config(), registry=SimpleNamespace(
        engines={"dec": engine}), spawn=loop.create_task)
    answers: list[Any] = []
    reports: list[tuple[float, P.Event]] = []

    async def main() -> Progressive:
        prog = Progressive(msg=pull_msg(), local_block_tokens=4, started_s=loop.time(),
                           hold_timeout_s=5.0)
        sealed = P.Sealed(state="open", generation=0, num_tokens=4, block_ids=[5],
                          block_size_tokens=4)
        runner = ProgressiveRunner(prog, SealedPeers(sealed), svc, engine,
                                   lambda child, answer: answers.append(answer),
                                   lambda p, event: reports.append((loop.time(), event)))
        task = loop.create_task(runner.run())
        await asyncio.sleep(20.0)  # the range's READs end (failed) long past the timeout
        assert prog.state is ProgState.FAILING and not reports
        (answer,) = answers
        answer.push("dec", P.Event(kind="done_recving", request_id="r~~p1", ok=False,
                                   error="transfer_failed: stalled"))
        await asyncio.wait_for(task, 1.0)
        return prog

    start_s = loop.time()
    prog = loop.run_until_complete(main())
    assert prog.state is ProgState.FAILED and prog.error.startswith("timeout")
    ((at_s, event),) = reports
    assert at_s >= start_s + 20.0 and not event.ok and event.invalid_block_ids == [1, 2]
    assert clock.waits < 10

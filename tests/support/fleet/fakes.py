"""What kvd's real code touches of one simulated daemon: its engines' registrations, its
registry, its clock, its events, its services; and the real producer over them.

Each daemon's clock (`FakeDaemonClock`) is the fleet loop's time, but nothing of it
fires while its daemon is frozen or busy, and nothing after it crashed: the real
`PullDriver`'s sleeps, heartbeats and deadline wait with the daemon.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvd.config import Config
from kvd.daemon.produce.producer import Producer
from kvd.errors import NotFoundError
from kvd.planner import RankId
from kvd.planner.layout import CacheLayout
from kvd.pool.geometry import parallelism
from kvd.wire import protocol as P
from support.fleet import layouts

if TYPE_CHECKING:
    from support.fleet.daemon import Daemon, SimEngine

T = TypeVar("T")
POOL_SPAN = 1 << 20  # a READ's address: registration uid * POOL_SPAN + block
MODEL = P.ModelSpec(name="sim", num_kv_heads=2, num_layers=1, head_dim=8)


class FakeMetrics:
    """Metrics: every attribute, call and label is a no-op."""

    def __getattr__(self, _: str) -> FakeMetrics:
        return self

    def __call__(self, *_: Any, **__: Any) -> FakeMetrics:
        return self


NOP = FakeMetrics()


class FakeRank:
    __slots__ = ("reg", "pins")

    def __init__(self, reg: FakeEngine) -> None:
        self.reg = reg
        self.pins = 0

    @property
    def gone(self) -> bool:
        return self.reg.state != "live"

    # the pool's span, where a READ of more than a few descriptors names it
    # (kvd.daemon.pull.movers.build_posts)
    device_id = 0

    @property
    def pool(self) -> SimpleNamespace:
        return SimpleNamespace(addr=self.reg.uid * POOL_SPAN, nbytes=self.reg.pool.nbytes)


class FakeLayout:
    def __init__(self, num_blocks: int, block_size_tokens: int) -> None:
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens


class FakeEngine:
    """One registration of an engine on a daemon, as kvd's registry keeps it (the pool, the
    rank and its pins, the epoch). ``state``: live, retired (left, pool kept while
    pinned), freed, dead (its daemon crashed)."""

    mem_type = "DRAM"

    def __init__(self, engine: SimEngine, daemon: Daemon, pool: np.ndarray, epoch: int) -> None:
        self.engine_id = engine.name
        self.engine = engine
        self.daemon = daemon
        self.pool = pool
        self.epoch = epoch
        self.state = "live"
        self.rank = FakeRank(self)
        self.model = MODEL
        self.par = parallelism(1, 1, None)
        self.layout = FakeLayout(pool.shape[0], engine.block_tokens)
        self.cache: CacheLayout | None = None  # kvd's layout of the pool (engine_block_tokens)
        if daemon.sim.layout is not None:
            self.model = layouts.MODEL
            self.cache = layouts.cache(daemon.sim.layout, pool.shape[0], engine.block_tokens)
        self.engine_daemons: list[str] = []
        self.uid = next(daemon.sim.uids)
        daemon.sim.regs[self.uid] = self

    def live_ranks(self) -> list[FakeRank]:
        return [self.rank] if self.state == "live" else []

    # what kvd.daemon.pull.local.LocalPeers asks of a producer engine in its registry

    @property
    def compat(self) -> str:
        return "sim"  # every engine of a run pairs with every other

    def missing_ranks(self, address: str) -> list[RankId]:
        return []  # its one rank is here

    def desc(self) -> SimpleNamespace:
        """The engine as a local pull's "handshake" sees it (P.EngineDesc's part that
        LocalPeers reads: its epoch and ranks; the pool's uid for the assembly)."""
        rank = SimpleNamespace(tp_rank=0, pp_rank=0, base_addr=self.uid * POOL_SPAN,
                               nbytes=self.pool.nbytes, device_id=0)
        return SimpleNamespace(epoch=self.epoch, ranks=[rank], mem_type=self.mem_type,
                               uid=self.uid)

    def __repr__(self) -> str:
        return f"<reg {self.engine_id}@{self.daemon.instance} {self.state} pins={self.rank.pins}>"


class FakeRegistry:
    """What the real Producer and PullDriver ask of the registry."""

    def __init__(self) -> None:
        self.engines: dict[str, FakeEngine] = {}
        self._gone: list[Callable[[str], None]] = []

    def get(self, engine_id: str) -> FakeEngine:
        reg = self.engines.get(engine_id)
        if reg is None:
            raise NotFoundError(f"engine {engine_id!r} is not registered on this daemon")
        return reg

    async def complete(self, engine_id: str, timeout_s: float) -> FakeEngine:
        """Every rank of the engine is here (it has one) or it is not registered."""
        return self.get(engine_id)

    def rank_ids(self, engine_id: str) -> list[RankId]:
        return [RankId(0, 0)] if engine_id in self.engines else []

    def on_engine_gone(self, cb: Callable[[str], None]) -> None:
        self._gone.append(cb)

    def gone(self, engine_id: str) -> None:
        for cb in self._gone:
            cb(engine_id)


class _Later:
    """A timer of one daemon: fires unless cancelled (`Clock.call_later`'s handle)."""

    __slots__ = ("fn", "cancelled")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __call__(self) -> None:
        if not self.cancelled:
            self.fn()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class FakeDaemonClock:
    """``kvd.daemon.clock.Clock`` of one daemon: the fleet loop's time; its timers run
    through the daemon (`Daemon.after`), so they wait while it is frozen or busy and
    never fire after it crashed."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.loop = daemon.sim.loop

    def now(self) -> float:
        return self.loop._now

    def __call__(self) -> float:
        return self.loop._now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        self.daemon.after(seconds, _wake, fut)
        await fut

    def call_later(self, seconds: float, fn: Callable[[], object]) -> _Later:
        later = _Later(fn)
        self.daemon.after(seconds, later)
        return later

    async def wait_for(self, aw: Awaitable[T], timeout_s: float) -> T:
        fut = asyncio.ensure_future(aw)
        expired = []

        def expire() -> None:
            if not fut.done():
                expired.append(True)
                fut.cancel()

        timer = self.call_later(timeout_s, expire)
        try:
            return await fut
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError(f"timed out after {timeout_s} s") from None
            raise
        finally:
            timer.cancel()


class FakeEvents:
    """The engine face's events: delivered to the simulated engine; the last one kept
    for the pull's report checks."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.last: P.Event | None = None

    def push(self, engine_id: str, event: P.Event) -> None:
        self.last = event
        self.daemon.deliver_event(engine_id, event)


class FakeServices:
    """The part of kvd.daemon.services.Services the real Producer and PullDriver use."""

    def __init__(self, daemon: Daemon, cfg: Config) -> None:
        self.cfg = cfg
        self.clock = FakeDaemonClock(daemon)
        self.registry = FakeRegistry()
        self.metrics = NOP
        self.events = FakeEvents(daemon)
        self.instance_id = daemon.instance
        self.spans = None  # no OpenTelemetry spans in the simulation
        self.datapath = None  # notices go as peer requests, answered
        self.spawn = daemon.spawn

    def with_events(self, events: object) -> FakeServices:
        """These services with another event hub (a progressive pull's range pull reports
        to its runner, as kvd.daemon.pull.consumer.Consumer.start does)."""
        svc = copy.copy(self)
        svc.events = events  # type: ignore[assignment]
        return svc


class SimProducer(Producer):
    """The real producer; each hold's end is checked against its reason first."""

    daemon: Daemon

    def finish(self, held: Any, outcome: str) -> None:
        key = (held.engine_id, held.request_id)
        if self.held.items.get(key) is held:
            if self.daemon.sim.trace is not None:
                self.daemon.sim.note(f"{self.daemon.instance} hold {key} ends {outcome}")
            if not (outcome == "cancelled" and self._range_voided(key)):
                self.daemon.sim.check_hold_end(self.daemon, held, outcome)
        super().finish(held, outcome)

    def _range_voided(self, key: tuple[str, str]) -> bool:
        """A range hold dropped with its generation (unsealed: the engine freed the blocks)
        or with its progressive hold (ended): whatever its reader gets of it is void (the
        progressive pull reads again or fails), so it may end under a running READ."""
        parent = self._ranges.get(key)
        if parent is None:
            return False
        opened = self.opened.items.get(parent)
        parsed = P.parse_range_request_id(key[1])
        assert parsed is not None
        return opened is None or opened.terminal or parsed[1] != opened.generation

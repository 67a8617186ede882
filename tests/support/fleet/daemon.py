"""The simulated engines and daemons: the engines publish, pull, take their events,
leave and come back; each daemon runs kvd's real producer (`SimProducer`) and, for
every pull, kvd's real `PullDriver` with its machine, over the daemon's fakes.

A daemon's callbacks and its tasks' wakeups go through `Daemon.after`: nothing of it
runs while it is frozen or busy (deferred until it runs again), nothing survives its
crash (its tasks are never woken again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.produce.local_peer import local_peer
from kvd.daemon.pull.driver import PullDriver
from kvd.daemon.pull.local import LocalPeers
from kvd.daemon.pull.machine import Pull
from kvd.daemon.pull.progressive import ProgressiveRunner
from kvd.daemon.pull.quarantine import QuarantineCounts
from kvd.errors import BusyError, KvdError, NotFoundError, PeerLostError
from kvd.wire import protocol as P
from support.fleet import layouts
from support.fleet.fakes import NOP, FakeEngine, FakeServices, SimProducer
from support.fleet.network import FakePeers, Request
from support.fleet.transport import FakeHostMaps, FakeMover, assemble

if TYPE_CHECKING:
    from kvd.daemon.peers.reply import Reply
    from support.fleet.sim import Sim

T = TypeVar("T")
HOUSEKEEPING_S = 0.05  # kvd.daemon.server: housekeeping (lease expiry, pool collection)


# ------------------------------------------------------------------ engines


@dataclass(eq=False)
class PullRec:
    """The sim's record of one pull (ground truth, not kvd's)."""

    uid: int
    consumer: SimEngine
    daemon: Daemon
    inc: int
    request_id: str
    producer_engine: str
    remote_rid: str
    local_blocks: list[int]
    expected: np.ndarray | None  # the bytes published (None: never published)
    started_s: float
    hold_key: tuple[str, str, str]  # (producer instance, engine, request)
    outcome: str = ""
    outcome_s: float = 0.0
    accepted: bool = False
    big: bool = False
    pull: Pull | None = None  # kvd's record of it, once its daemon took it
    parent: PullRec | None = None  # a range pull's progressive pull (its blocks' owner)

    @property
    def label(self) -> str:
        return f"pull#{self.uid}({self.consumer.name}:{self.request_id})"


@dataclass(eq=False)
class PubRec:
    uid: int
    engine: SimEngine
    request_id: str
    blocks: list[int]
    reg: FakeEngine
    receipt: str = ""
    expected: np.ndarray | None = None
    ended: bool = False
    computing: bool = False  # a progressive prefill still running: its blocks stay its own

    @property
    def label(self) -> str:
        return f"publish#{self.uid}({self.engine.name}:{self.request_id})"


class SimEngine:
    """An engine: owns blocks (free, published, being pulled into), talks to its daemon."""

    def __init__(self, sim: Sim, daemon: Daemon, name: str, k: int = 0) -> None:
        self.sim = sim
        self.daemon = daemon
        self.name = name
        sizes = sim.knobs.engine_block_tokens  # k: the engine's index in the fleet
        self.block_tokens = sizes[k % len(sizes)] if sizes else sim.knobs.block_tokens
        self.block_bytes = (layouts.block_bytes(self.block_tokens) if sizes
                            else sim.knobs.block_bytes)
        self.reg: FakeEngine | None = None
        self.pool: np.ndarray | None = None  # the pool this engine maps (its daemon's)
        self.owner: dict[int, PullRec | PubRec] = {}
        self.pulls: dict[str, PullRec] = {}
        self.pubs: dict[str, PubRec] = {}
        self.away = False
        self.registering = False

    def free_blocks(self) -> list[int]:
        return [b for b in range(self.sim.knobs.num_blocks) if b not in self.owner]

    def register(self, adopt: bool) -> None:
        """Register (again), through the engine face: the engine takes no blocks until its
        daemon answered."""
        d = self.daemon
        if not d.up or self.away:
            return
        self.registering = True

        def handle() -> None:
            if self.away or not self.registering:
                return
            self.registering = False
            if adopt and self.pool is not None:
                pool = self.pool
            else:
                pool = self.sim.data_rng.integers(0, 256, (self.sim.knobs.num_blocks,
                                                           self.block_bytes), np.uint8)
            self.pool = pool
            self.reg = FakeEngine(self, d, pool, next(self.sim.epochs))
            d.regs.append(self.reg)
            d.svc.registry.engines[self.name] = self.reg

        d.engine_face(handle)

    def give_back(self, rec: PullRec | PubRec, scribble: bool) -> None:
        if self.sim.trace is not None:
            self.sim.note(f"{self.name} gives back {rec.label} scribble={scribble}")
        for b, o in list(self.owner.items()):
            if o is rec:
                del self.owner[b]
                if scribble and self.pool is not None:  # reused at once by the engine
                    self.pool[b] = self.sim.data_rng.integers(0, 256, self.block_bytes, np.uint8)

    def _give_back_all(self, scribble_pubs: bool) -> None:
        for rec in list(self.pulls.values()):
            self.give_back(rec, scribble=False)
        for pub in list(self.pubs.values()):
            self.give_back(pub, scribble=scribble_pubs)
        self.pulls.clear()
        self.pubs.clear()

    def lost_daemon(self) -> None:
        """Its daemon died: every pull and publish with it is lost (the engine recomputes),
        its blocks are its own again (a publish's reused at once)."""
        self._give_back_all(scribble_pubs=True)
        self.reg = None
        self.registering = False

    def leave(self) -> None:
        d = self.daemon
        self.away = True
        reg, self.reg = self.reg, None
        self._give_back_all(scribble_pubs=False)
        self.owner.clear()
        self.pool = None
        if reg is not None and d.up and reg.state == "live":
            d.engine_face(lambda: d.deregister(reg))

    def come_back(self) -> None:
        self.away = False
        self.register(adopt=False)

    def on_event(self, reg: FakeEngine, event: P.Event) -> None:
        if reg is not self.reg:
            return  # an earlier registration's event: nobody listens for it any more
        rid = event.request_id
        if event.kind == "done_recving":
            rec = self.pulls.pop(rid, None)
            if rec is None:
                return
            self.give_back(rec, scribble=False)
        else:
            pub = self.pubs.get(rid)
            if pub is None:
                return
            pub.ended = True
            if not pub.computing:  # else given back when the prefill ends
                del self.pubs[rid]
                self.give_back(pub, scribble=True)


# ------------------------------------------------------------------ one daemon


class Daemon:
    def __init__(self, sim: Sim, index: int) -> None:
        self.sim = sim
        self.index = index
        self.name = f"d{index}"
        self.addr = f"tcp://d{index}:1"
        self.inc = 0
        self.up = False
        self.frozen = False
        self.busy = False  # its loop runs something else: callbacks wait, copies go on
        self.deferred: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self.engines: list[SimEngine] = []
        self.start()

    @property
    def instance(self) -> str:
        return f"{self.name}.{self.inc}"

    @property
    def agent(self) -> str:
        return f"agent-{self.instance}"

    def start(self) -> None:
        sim = self.sim
        self.inc += 1
        self.up = True
        self.regs: list[FakeEngine] = []
        self.svc = FakeServices(self, sim.cfg)
        self.producer = SimProducer(self.svc)  # type: ignore[arg-type]
        self.producer.daemon = self
        self.peers = FakePeers(self)
        # a local pull's peers: kvd's own LocalPeers over this daemon's producer
        self.local_peers = LocalPeers(self.svc.registry, self.local_dispatch,  # type: ignore
                                      self.addr, self.agent, self.instance, self.svc.clock.now)
        self.quarantine = QuarantineCounts(sim.cfg, NOP)  # type: ignore[arg-type]
        self.drivers: dict[tuple[str, str], PullDriver] = {}  # as Consumer.pulls
        self.recs: dict[tuple[str, str], PullRec] = {}
        self.progressive: dict[tuple[str, str], ProgressiveRunner] = {}  # as Consumer's
        self.remotes: dict[tuple[str, str], RemoteEngine] = {}  # as PeerTable.remotes
        self.pending: dict[int, Request] = {}
        self.xfers: set[int] = set()
        self.face_s = 0.0
        self.lost: set[int] = set()  # daemons whose connection liveness lost
        self.dead_seen: set[str] = set()  # incarnations whose connections were reset
        sim.agents[self.agent] = self
        self.after(HOUSEKEEPING_S, self.housekeeping)

    # scheduling: nothing of a daemon runs while it is frozen, nothing survives its crash

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        loop = self.sim.loop
        loop.at(loop._now + delay_s, self._run, (self.inc, fn, args))

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task of this daemon (Services.spawn): it runs when what it waits for comes
        through the daemon (`after`); kept until the run ends, when a crashed daemon's
        tasks, never woken again, are closed."""
        task = self.sim.loop.create_task(coro)
        self.sim.tasks.append(task)
        task.add_done_callback(self.sim.task_done)
        return task

    def _run(self, inc: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        if inc != self.inc or not self.up:
            return
        if self.frozen or self.busy:
            self.deferred.append((fn, args))
            return
        fn(*args)

    def resume(self) -> None:
        self.frozen = False
        todo, self.deferred = self.deferred, []
        for fn, args in todo:
            self.after(0.0, fn, *args)

    def engine_face(self, fn: Callable[[], None]) -> None:
        """An engine's request, handled by the daemon in the order sent (the engine face is
        local and never faulted)."""
        t = max(self.sim.now + self.sim.net_rng.uniform(0.00005, 0.0003), self.face_s + 1e-6)
        self.face_s = t
        self.after(t - self.sim.now, fn)

    def deliver_event(self, engine_id: str, event: P.Event) -> None:
        reg = self.svc.registry.engines.get(engine_id)
        if reg is None:
            return
        self.after(self.sim.net_rng.uniform(0.00005, 0.0005), reg.engine.on_event, reg, event)

    # engine face

    def deregister(self, reg: FakeEngine) -> None:
        if self.svc.registry.engines.get(reg.engine_id) is reg:
            del self.svc.registry.engines[reg.engine_id]
        reg.state = "retired"
        self.svc.registry.gone(reg.engine_id)

    def housekeeping(self) -> None:
        sim = self.sim
        self.producer.expire(sim.now)
        freed = False
        for reg in self.regs:
            if reg.state == "retired" and reg.rank.pins == 0:
                reg.state, freed = "freed", True
            if reg.rank.pins < 0:
                sim.violate(f"{reg} has negative pins")
        if freed:
            self.regs = [r for r in self.regs if r.state != "freed"]
        sim.check_bounds(self)
        self.after(HOUSEKEEPING_S, self.housekeeping)
        if len(sim.loop._timers) <= len(sim.daemons) and not sim.loop._ready:
            sim.stop_if_idle()

    # peer face: requests from other daemons

    def on_request(self, src: Daemon, req: Request) -> None:
        msg, prod = req.msg, self.producer
        if self.sim.trace is not None:
            self.sim.note(f"{self.instance} <- {req.instance} {type(msg).__name__} "
                          f"{getattr(msg, 'request_id', '')}")
        try:
            if isinstance(msg, P.Hello):
                reg = self.svc.registry.get(msg.remote_engine_id)
                self.reply(src, req, ("hello", self.agent, reg.epoch, reg.uid))
            elif isinstance(msg, P.Acquire):
                if prod.acquire_must_wait(msg):
                    self.spawn(self._acquire_later(src, req))
                else:
                    self.reply(src, req, prod.acquire(msg, req.instance))
            elif isinstance(msg, P.Heartbeat):
                self.reply(src, req, prod.heartbeat(msg))
            elif isinstance(msg, P.Abandon):
                self.reply(src, req, prod.abandon(msg, req.instance))
            elif isinstance(msg, P.ReadNotice):
                prod.on_notice(msg, req.instance)
                self.reply(src, req, P.Ok())
            elif isinstance(msg, P.Watch):  # a long poll: answered at the first change
                self.spawn(self._answer_later(src, req, prod.watch(msg)))
            else:
                raise AssertionError(msg)
        except KvdError as exc:
            self.reply(src, req, exc)

    def local_dispatch(self, msg: object) -> object:
        """The daemon's own dispatch (kvd.daemon.produce.local_peer); what must wait is a
        task of this daemon (`spawn`: it waits with it, and dies with it)."""
        return local_peer(self.producer, msg, self.instance, later=self.spawn)

    async def _acquire_later(self, src: Daemon, req: Request) -> None:
        """The real Producer.acquire_when_published: up to ACQUIRE_WAITS_FOR_PUBLISH_S for
        the Publish; an Abandon meanwhile refuses it."""
        await self._answer_later(src, req,
                                 self.producer.acquire_when_published(req.msg, req.instance))

    async def _answer_later(self, src: Daemon, req: Request, body: Awaitable[Any]) -> None:
        """The peer face's answer_later: the reply once ``body`` is ready."""
        try:
            reply: Any = await body
        except KvdError as exc:
            reply = exc
        self.reply(src, req, reply)

    def reply(self, src: Daemon, req: Request, body: Any) -> None:
        self.sim.net.send_reply(self, src, req, body)

    # consumer: requests to other daemons

    def request(self, addr: str, msg: Any, timeout_s: float | None,
                then: Callable[[Reply | KvdError], None]) -> None:
        self.sim.net.request(self, addr, msg, timeout_s or self.sim.cfg.handshake_timeout_s, then)

    def drop_address(self, addr: str) -> None:
        for key, remote in list(self.remotes.items()):
            if addr in remote.daemons:
                del self.remotes[key]

    def unreachable(self, addrs: list[str]) -> frozenset[str]:
        return frozenset(a for a in addrs if self.sim.by_addr[a].index in self.lost)

    def on_lost(self, dst: Daemon) -> None:
        """Liveness lost the control connection to ``dst``: its requests fail, what we
        cached about it goes."""
        self.lost.add(dst.index)
        if not dst.up:  # its connections were reset: nothing more comes from it
            self.dead_seen.add(dst.instance)
        for rid, req in list(self.pending.items()):
            if req.dst is dst:
                del self.pending[rid]
                req.then(PeerLostError(f"connection to {dst.addr} lost"))
        self.drop_address(dst.addr)

    def conn_reset(self, dst: Daemon, instance: str) -> None:
        """The connections to incarnation ``instance`` of ``dst`` were reset (it died): its
        requests fail, what we cached about that address goes."""
        self.dead_seen.add(instance)
        if not dst.up:
            self.lost.add(dst.index)
        for rid, req in list(self.pending.items()):
            if req.dst is dst and req.dst_instance == instance:
                del self.pending[rid]
                req.then(PeerLostError(f"connection to {dst.addr} reset"))
        self.drop_address(dst.addr)

    def admit(self, msg: P.Pull, in_flight: int) -> Any:
        """Consumer's admission of a pull (its registration), or the KvdError it refuses
        with: the engine registered, the request not already pulled, fewer than
        ``max_inflight_pulls`` counted as ``in_flight``."""
        reg = self.svc.registry.engines.get(msg.engine_id)
        if reg is None:
            raise NotFoundError(f"engine {msg.engine_id!r} is not registered")
        key = (msg.engine_id, msg.request_id)
        if key in self.drivers or key in self.progressive:
            raise KvdError(f"request {msg.request_id!r} is already being pulled")
        if in_flight >= self.sim.cfg.max_inflight_pulls:
            raise BusyError("pulls in flight (max_inflight_pulls)")
        return reg

    def start_pull(self, rec: PullRec, msg: P.Pull, events: object | None = None) -> None:
        """Consumer.start: refuse cheaply, or hand the pull to the real PullDriver (inline
        first, then its task), with this daemon's fakes for its I/O. ``events``: a
        progressive pull's range reports there, and a refusal is raised to its runner."""
        sim = self.sim
        try:
            reg = self.admit(msg, len(self.drivers))
        except KvdError:
            rec.outcome, rec.outcome_s = "refused", sim.now
            if events is not None:
                raise
            rec.consumer.pulls.pop(rec.request_id, None)
            rec.consumer.give_back(rec, scribble=False)
            return
        rec.accepted = True
        producer = sim.by_addr.get(msg.remote_address)
        local = producer is self  # Consumer.route_for: this daemon's own producer side
        host = (producer is not None and producer is not self
                and {self.index, producer.index} <= set(sim.knobs.host_daemons))
        remote_mover = FakeMover(self, rec, host=local, local=local)
        peers: Any = self.local_peers if local else self.peers
        pull = Pull(msg=msg, started_s=sim.now, path=remote_mover.path,
                    liveness_timeout_s=sim.cfg.peer_liveness_timeout_s,
                    transfer_timeout_s=sim.cfg.transfer_timeout_s)
        rec.pull = pull

        def pick(remote: RemoteEngine) -> tuple[FakeMover, FakeHostMaps | None]:
            """Consumer.pick: the host path between daemons of one host."""
            if host:
                return FakeMover(self, rec, host=True), FakeHostMaps(sim, remote)
            return remote_mover, None

        block_bytes = sim.knobs.block_bytes
        svc = self.svc if events is None else self.svc.with_events(events)
        driver = PullDriver(
            svc, pull, remote_mover, peers, self.quarantine,  # type: ignore[arg-type]
            lambda p, engine, remote: assemble(rec, block_bytes, engine, remote),
            self.on_reported, pick=None if local else pick)
        self.drivers[pull.key] = driver
        self.recs[pull.key] = rec
        if sim.trace is not None:
            sim.note(f"{self.instance} {rec.label} starts "
                     f"({'local' if local else 'host' if host else 'remote'})")
        if not driver.run_now(reg, peers.cached(
                msg.engine_id, msg.remote_engine_id, msg.remote_address)):
            driver.task = self.spawn(driver.run())

    def on_reported(self, pull: Pull) -> None:
        """Consumer._reported, and the simulation's checks of the report: once, in a final
        state, ok only with the published bytes in the engine's blocks (a range pull's
        bytes are judged when its progressive pull reports)."""
        sim = self.sim
        driver = self.drivers.pop(pull.key)
        rec = self.recs.pop(pull.key)
        event = driver.svc.events.last
        assert event is not None and event.request_id == pull.msg.request_id
        if sim.trace is not None:
            sim.note(f"{self.instance} {rec.label} reported {pull.state.value} "
                     f"{event.error or ''}")
        sim.on_outcome(rec, "ok" if event.ok else "failed", pull)
        if event.ok and rec.parent is None:
            engine = driver.engine
            assert engine is not None
            if rec.expected is None:
                sim.violate(f"{rec.label} of a request never published reported ok")
            elif not np.array_equal(engine.pool[rec.local_blocks], rec.expected):
                sim.violate(f"{rec.label} reported ok with wrong bytes")

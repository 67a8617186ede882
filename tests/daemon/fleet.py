"""A deterministic simulation of a kvd fleet: several daemons in one process, one fake clock.

What is real and what is simulated:

* real: each pull is a `kvd.daemon.pull.machine.Pull` (its transition table, its
  decisions), each published request a `kvd.daemon.produce.held.HeldRequest` in the
  real `HeldTable`, and the producer side is the real `kvd.daemon.produce.producer.
  Producer` (publish, acquire, heartbeats, notices, abandon, lease expiry with the
  frozen-daemon postponement, engine gone) over a stand-in `Services`; what a post pins
  is `PullDriver._pin`'s own decision;
* simulated: the pull's driver (`SimDriver`, carrying out the machine's actions with the
  semantics of kvd.daemon.pull.driver, on sim time: a Sever fails a stalled READ at its
  next poll, Release happens only once the transfers ended, the deadline cancels what
  the pull waits for, the end is never cancelled), the cached handshakes (as
  kvd.daemon.peers.table), the control network (requests and replies with delays;
  partitions; dropped, delayed, duplicated and reordered messages, in order on one
  connection unless ``Knobs.fifo`` is off; liveness that notices a silent peer after
  ``peer_liveness_timeout_s``, and a dead one at once), the transport (`Transport`:
  READs that copy bytes between numpy pools descriptor by descriptor, each write
  recorded with its time), the engines (publish, pull, take their events, leave and
  come back) and the faults.

Everything runs on one heap of timed events with seeded `random.Random` streams: the
same (seed, fault list) gives the same run, event for event. `run(seed)` builds the
fault schedule from the seed; `run(seed, faults=...)` replays a given (shrunk) one.
Invariants are checked as the run goes (`Violation` on the first broken one) and after
quiescence (`Sim.check_quiescent`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.config import Config
from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.produce.held import HeldState
from kvd.daemon.produce.producer import ACQUIRE_WAITS_FOR_PUBLISH_S, Producer
from kvd.daemon.pull import machine as M
from kvd.daemon.pull.driver import PROBE_TIMEOUT_S, PullDriver
from kvd.daemon.pull.inputs import (
    AcquireSent,
    Assembled,
    AssemblyFailed,
    Begin,
    Confirmed,
    Discarded,
    Greeted,
    Interrupted,
    LeaseReply,
    Polled,
    Posted,
    Probed,
    Raised,
    RanksReady,
    Released,
    RepliesIn,
)
from kvd.daemon.pull.state import Path, PullState
from kvd.errors import (
    BusyError,
    KvdError,
    KvdTimeoutError,
    NotFoundError,
    PeerLostError,
    TransferError,
)
from kvd.planner import RankId
from kvd.pool.geometry import parallelism
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from kvd.wire import protocol as P

POOL_SPAN = 1 << 20  # a READ's remote address: registration uid * POOL_SPAN + block
logging.getLogger("kvd").setLevel(logging.CRITICAL)  # the sim's checks are what count

KNOWN_DEAD_WAIT_S = 0.3  # kvd.daemon.peers.table: a handshake to a daemon known lost
HOUSEKEEPING_S = 0.05  # kvd.daemon.server: housekeeping (lease expiry, pool collection)
MODEL = P.ModelSpec(name="sim", num_kv_heads=2, num_layers=1, head_dim=8)
FAULT_KINDS = ("freeze", "crash", "partition", "msg", "read", "leave")


class Violation(AssertionError):
    """An invariant broken: the message says which, when and where."""


# ------------------------------------------------------------------ knobs and faults


@dataclass(frozen=True)
class Knobs:
    daemons: int = 3
    num_blocks: int = 12
    block_bytes: int = 16
    horizon_s: float = 4.0  # work and faults start within it
    ops: int = 10  # transfers (a publish and its pulls) the engines start
    max_faults: int = 6
    max_freeze_s: float = 3.0  # past lease_s and liveness_s
    kinds: tuple[str, ...] = FAULT_KINDS  # the faults drawn
    msg_fault_p: float = 0.5  # share of the messages a ``msg`` window hits
    # Messages keep their order on one connection (an incarnation pair), as ZMQ over TCP
    # does: a delayed one holds up those after it, and only messages on different
    # connections (another incarnation's) overtake each other. False: any may overtake.
    fifo: bool = True
    lease_s: float = 2.0
    heartbeat_interval_s: float = 0.25
    liveness_s: float = 1.0
    transfer_timeout_s: float = 4.0
    handshake_timeout_s: float = 1.0
    max_inflight_pulls: int = 6
    max_held: int = 12
    max_quarantined_pulls: int = 3
    # Daemons that share one host: pulls between two of them take the host path (the
    # producer's pool files mapped, a copy that never fails when its owner dies).
    host_daemons: tuple[int, ...] = ()

    @property
    def end_s(self) -> float:
        """Every fault has healed, and every bound has run out, well before this."""
        return (self.horizon_s + 3.5 + self.transfer_timeout_s + self.lease_s * 2
                + self.liveness_s + 2.0)

    def config(self) -> Config:
        return Config(lease_s=self.lease_s, heartbeat_interval_s=self.heartbeat_interval_s,
                      peer_liveness_timeout_s=self.liveness_s,
                      transfer_timeout_s=self.transfer_timeout_s,
                      handshake_timeout_s=self.handshake_timeout_s,
                      max_inflight_pulls=self.max_inflight_pulls,
                      max_held_requests=self.max_held,
                      max_quarantined_pulls=self.max_quarantined_pulls)


@dataclass(frozen=True)
class Fault:
    """One injected fault. ``a``/``b``: daemon indexes (``b``: the other end of a link, or
    the engine's index on daemon ``a`` for ``leave``); ``x``: its flavour."""

    kind: str
    at_s: float
    dur_s: float
    a: int
    b: int = -1
    x: str = ""

    def __str__(self) -> str:
        where = {"partition": f"d{self.a}<->d{self.b}", "msg": f"d{self.a}<->d{self.b}",
                 "leave": f"engine {self.a}.{self.b}"}.get(self.kind, f"d{self.a}")
        what = f"{self.kind}({self.x})" if self.x else self.kind
        return f"{self.at_s:7.3f}s +{self.dur_s:.3f}s {what} {where}"


def fault_schedule(seed: int, knobs: Knobs) -> list[Fault]:
    rng = random.Random(f"faults-{seed}")
    more = random.Random(f"faults2-{seed}")  # later additions: the first stream stays
    out = []
    for _ in range(rng.randint(0, knobs.max_faults)):
        kind = rng.choice(knobs.kinds)
        at = round(rng.uniform(0.0, knobs.horizon_s), 4)
        a = rng.randrange(knobs.daemons)
        b = rng.choice([i for i in range(knobs.daemons) if i != a])
        if kind == "freeze":
            out.append(Fault(kind, at, round(rng.uniform(0.05, knobs.max_freeze_s), 4), a))
        elif kind == "crash":
            out.append(Fault(kind, at, round(rng.uniform(0.05, 2.0), 4), a,
                             x=rng.choice(["adopt", "lose"])))
        elif kind == "partition":
            out.append(Fault(kind, at, round(rng.uniform(0.05, 3.0), 4), a, b))
        elif kind == "msg":
            out.append(Fault(kind, at, round(rng.uniform(0.1, 2.0), 4), a, b,
                             x=rng.choice(["drop", "delay", "dup", "reorder"])))
        elif kind == "read":
            dur, x = round(rng.uniform(0.1, 1.5), 4), rng.choice(["stall", "fail", "late"])
            if more.random() < 0.3:  # past the lease, or the pull's deadline
                dur = round(dur * 4, 4)
            if x == "stall" and more.random() < 0.4:  # READs that never end unless severed
                x = "hang"
            out.append(Fault(kind, at, dur, a, x=x))
        elif kind == "busy":  # the loop busy under the liveness timeout; copies go on
            out.append(Fault(kind, at, round(rng.uniform(0.05, knobs.liveness_s * 0.95), 4),
                             a))
        else:
            out.append(Fault(kind, at, round(rng.uniform(0.1, 2.0), 4), a, rng.randrange(2)))
    return sorted(out, key=lambda f: f.at_s)


# ------------------------------------------------------------------ small stand-ins


class _Nop:
    """Metrics: every attribute, call and label is a no-op."""

    def __getattr__(self, _: str) -> _Nop:
        return self

    def __call__(self, *_: Any, **__: Any) -> _Nop:
        return self


NOP = _Nop()


@dataclass
class SimRank:
    reg: Reg
    pins: int = 0

    @property
    def gone(self) -> bool:
        return self.reg.state != "live"


@dataclass
class Layout:
    num_blocks: int


class Reg:
    """One registration of an engine on a daemon: what the daemon's registry keeps (the
    pool, the rank and its pins, the epoch). ``state``: live, retired (left, pool kept
    while pinned), freed, dead (its daemon crashed)."""

    def __init__(self, engine: SimEngine, daemon: Daemon, pool: np.ndarray, epoch: int) -> None:
        self.engine_id = engine.name
        self.engine = engine
        self.daemon = daemon
        self.pool = pool
        self.epoch = epoch
        self.state = "live"
        self.rank = SimRank(self)
        self.model = MODEL
        self.par = parallelism(1, 1, None)
        self.layout = Layout(pool.shape[0])
        self.engine_daemons: list[str] = []
        self.uid = next(daemon.sim.uids)
        daemon.sim.regs[self.uid] = self

    def live_ranks(self) -> list[SimRank]:
        return [self.rank] if self.state == "live" else []

    def __repr__(self) -> str:
        return f"<reg {self.engine_id}@{self.daemon.instance} {self.state} pins={self.rank.pins}>"


class Registry:
    """What the real Producer asks of the registry."""

    def __init__(self) -> None:
        self.engines: dict[str, Reg] = {}
        self._gone: list[Callable[[str], None]] = []

    def get(self, engine_id: str) -> Reg:
        reg = self.engines.get(engine_id)
        if reg is None:
            raise NotFoundError(f"engine {engine_id!r} is not registered on this daemon")
        return reg

    def rank_ids(self, engine_id: str) -> list[RankId]:
        return [RankId(0, 0)] if engine_id in self.engines else []

    def on_engine_gone(self, cb: Callable[[str], None]) -> None:
        self._gone.append(cb)

    def gone(self, engine_id: str) -> None:
        for cb in self._gone:
            cb(engine_id)


class FakeFuture:
    """What Producer keeps in ``_unpublished`` for an Acquire waiting for its Publish."""

    def __init__(self, on_done: Callable[[bool], None]) -> None:
        self._result: bool | None = None
        self._on_done = on_done

    def done(self) -> bool:
        return self._result is not None

    def cancelled(self) -> bool:
        return False

    def result(self) -> bool | None:
        return self._result

    def set_result(self, value: bool) -> None:
        self._result = value
        self._on_done(value)


class Clock:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.now


class Events:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def push(self, engine_id: str, event: P.Event) -> None:
        self.daemon.deliver_event(engine_id, event)


class Services:
    """The part of kvd.daemon.services.Services the real Producer uses."""

    def __init__(self, daemon: Daemon, cfg: Config) -> None:
        self.cfg = cfg
        self.clock = Clock(daemon.sim)
        self.registry = Registry()
        self.metrics = NOP
        self.events = Events(daemon)
        self.instance_id = daemon.instance
        self.spans = None  # no OpenTelemetry spans in the simulation


class SimProducer(Producer):
    """The real producer; each hold's end is checked against its reason first."""

    daemon: Daemon

    def finish(self, held: Any, outcome: str) -> None:
        key = (held.engine_id, held.request_id)
        if self.held.items.get(key) is held:
            self.daemon.sim.note(f"{self.daemon.instance} hold {key} ends {outcome}")
            self.daemon.sim.check_hold_end(self.daemon, held, outcome)
        super().finish(held, outcome)


# ------------------------------------------------------------------ the transport


class Xfer:
    """One READ: descriptors copied one by one from a producer pool into a consumer pool."""

    def __init__(self, xid: int, consumer: Daemon, agent: str, src: Reg | None, dst: Reg,
                 pairs: list[tuple[int, int]], pull: PullRec, mode: str,
                 host: bool = False) -> None:
        self.id = xid
        self.consumer = consumer
        self.consumer_inc = consumer.inc
        self.agent = agent
        self.src = src
        self.dst = dst
        self.pairs = pairs
        self.pull = pull
        self.mode = mode  # ok, stall, fail, late
        self.state = XferState.PENDING
        self.error: TransferError | None = None
        self.released = False
        self.next = 0
        self.hold_key = pull.hold_key
        self.host = host  # a copy from mapped pool files: no agent, no failure of its own


class Transport:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.xfers: dict[int, Xfer] = {}
        self.ids = itertools.count(1)
        self.writes: list[tuple[float, str, str, int, str]] = []  # t, daemon, engine, block, pull

    def post(self, d: Daemon, posts: list[ReadPost], rec: PullRec, dst: Reg,
             host: bool = False) -> list[PostResult]:
        sim = self.sim
        out = []
        for post in posts:
            owner = sim.agents.get(post.peer)
            # the remote addresses name the pool (its registration) and the block in it
            src = sim.regs.get(int(post.remote_addrs[0]) // POOL_SPAN)
            if owner is None or (not host and (not owner.up or owner.agent != post.peer)):
                out.append(PostResult(None, False, TransferError(
                    f"nixl: unknown or dead remote agent {post.peer}")))
                continue
            mode = sim.read_mode(d)
            pairs = [(int(r) % POOL_SPAN, int(loc))
                     for r, loc in zip(post.remote_addrs, post.local_addrs, strict=True)]
            x = Xfer(next(self.ids), d, post.peer, src, dst, pairs, rec, mode, host)
            x.hold_key = (owner.instance, rec.producer_engine, rec.remote_rid)
            self.xfers[x.id] = x
            d.xfers.add(x.id)
            sim.after(sim.net_rng.uniform(0.0001, 0.002), self._step, x)
            out.append(PostResult(x.id, False))
        return out

    def _fail(self, x: Xfer, why: str) -> None:
        if x.state is XferState.PENDING:
            x.state, x.error = XferState.FAILED, TransferError(why)

    def _step(self, x: Xfer) -> None:
        sim = self.sim
        if x.state is not XferState.PENDING:
            return
        d = x.consumer
        if d.inc != x.consumer_inc or not d.up:  # its process died: nothing moves any more
            x.state = XferState.FAILED
            return
        if x.host:
            self._copy_step(x)
            return
        owner = sim.agents.get(x.agent)
        if owner is None or not owner.up or owner.agent != x.agent:
            sim.after(0.001, self._fail, x, "remote agent disconnected")
            return
        if x.mode == "fail":
            self._fail(x, "injected READ failure")
            return
        if x.mode == "hang":  # a READ the transport never ends: only a sever (or death) does
            return
        if (d.frozen or owner.frozen or sim.partitioned(d.index, owner.index)
                or (x.mode == "stall" and sim.read_fault_active(d, "stall"))):
            sim.after(0.02, self._step, x)  # no progress while either side cannot run
            return
        src_b, dst_b = x.pairs[x.next]
        src = x.src
        if src is None or src.state in ("freed", "dead") or src.daemon is not owner:
            self._fail(x, "remote memory not registered")
            return
        self.write(x, dst_b, src.pool[src_b])
        x.next += 1
        if x.next == len(x.pairs):
            x.state = XferState.DONE
            return
        delay = sim.net_rng.uniform(0.0001, 0.002)
        if x.mode == "late" and x.next == len(x.pairs) - 1:
            delay += sim.net_rng.uniform(0.3, 2.5)
        sim.after(delay, self._step, x)

    def _copy_step(self, x: Xfer) -> None:
        """A host-path copy: the consumer's copy threads read the producer's pool file,
        mapped here. Its owner dying, freezing or being cut off changes nothing (the pages
        stay, and an engine that reused its blocks after a restart is read as it is); only
        the consumer's own process stopping stops it (its loop being busy does not)."""
        sim, d = self.sim, x.consumer
        if x.mode == "fail":
            self._fail(x, "injected copy failure")
            return
        if d.frozen or (x.mode in ("stall", "hang") and sim.read_fault_active(d, "stall")):
            sim.after(0.02, self._step, x)
            return
        src_b, dst_b = x.pairs[x.next]
        assert x.src is not None
        self.write(x, dst_b, x.src.pool[src_b])
        x.next += 1
        if x.next == len(x.pairs):
            x.state = XferState.DONE
            return
        # A big one stands for ~a million small descriptors: seconds of copying.
        sim.after(sim.net_rng.uniform(0.02, 0.2) if x.pull.big
                  else sim.net_rng.uniform(0.0001, 0.002), self._step, x)

    def write(self, x: Xfer, block: int, data: np.ndarray) -> None:
        sim, dst = self.sim, x.dst
        rec = x.pull
        self.writes.append((sim.now, x.consumer.name, dst.engine_id, block, rec.label))
        sim.note(f"write {rec.label} x{x.id} block {block} from {x.hold_key}")
        if rec.outcome:
            sim.violate(f"READ of {rec.label} wrote block {block} of {dst.engine_id} after kvd "
                        f"reported the pull {rec.outcome} ({rec.outcome_s:.4f}s)")
        if dst.state == "freed":
            sim.violate(f"READ of {rec.label} wrote block {block} of {dst.engine_id}'s pool "
                        f"after the pool was freed")
        if dst.state == "live" and dst.engine.reg is dst:  # the engine uses this pool
            owner = dst.engine.owner.get(block)
            if owner is not rec:
                sim.violate(f"READ of {rec.label} wrote block {block} of {dst.engine_id} after "
                            f"kvd handed it back (now {owner.label if owner else 'free'})")
        dst.pool[block] = data

    def poll(self, handles: list[int]) -> dict[int, XferStatus]:
        return {h: XferStatus(self.xfers[h].state, self.xfers[h].error) for h in handles}

    def release(self, d: Daemon, handles: list[int]) -> None:
        for h in handles:
            x = self.xfers[h]
            if x.released:
                self.sim.violate(f"transfer {h} released twice")
            x.released = True  # a running READ runs on: releasing does not stop it
            d.xfers.discard(h)

    def sever(self, d: Daemon, agent: str) -> None:
        for h in list(d.xfers):
            x = self.xfers[h]
            if x.agent == agent and x.consumer_inc == d.inc:
                self._fail(x, "severed")


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

    @property
    def label(self) -> str:
        return f"pull#{self.uid}({self.consumer.name}:{self.request_id})"


@dataclass(eq=False)
class PubRec:
    uid: int
    engine: SimEngine
    request_id: str
    blocks: list[int]
    reg: Reg
    receipt: str = ""
    expected: np.ndarray | None = None
    ended: bool = False

    @property
    def label(self) -> str:
        return f"publish#{self.uid}({self.engine.name}:{self.request_id})"


class SimEngine:
    """An engine: owns blocks (free, published, being pulled into), talks to its daemon."""

    def __init__(self, sim: Sim, daemon: Daemon, name: str) -> None:
        self.sim = sim
        self.daemon = daemon
        self.name = name
        self.reg: Reg | None = None
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
                                                           self.sim.knobs.block_bytes), np.uint8)
            self.pool = pool
            self.reg = Reg(self, d, pool, next(self.sim.epochs))
            d.regs.append(self.reg)
            d.svc.registry.engines[self.name] = self.reg

        d.engine_face(handle)

    def give_back(self, rec: PullRec | PubRec, scribble: bool) -> None:
        self.sim.note(f"{self.name} gives back {rec.label} scribble={scribble}")
        for b, o in list(self.owner.items()):
            if o is rec:
                del self.owner[b]
                if scribble and self.pool is not None:  # reused at once by the engine
                    self.pool[b] = self.sim.data_rng.integers(0, 256, self.sim.knobs.block_bytes,
                                                              np.uint8)

    def lost_daemon(self) -> None:
        """Its daemon died: every pull and publish with it is lost (the engine recomputes),
        its blocks are its own again."""
        for rec in list(self.pulls.values()):
            self.give_back(rec, scribble=False)
        for pub in list(self.pubs.values()):
            self.give_back(pub, scribble=True)
        self.pulls.clear()
        self.pubs.clear()
        self.reg = None
        self.registering = False

    def leave(self) -> None:
        d = self.daemon
        self.away = True
        reg, self.reg = self.reg, None
        for rec in list(self.pulls.values()):
            self.give_back(rec, scribble=False)
        for pub in list(self.pubs.values()):
            self.give_back(pub, scribble=False)
        self.pulls.clear()
        self.pubs.clear()
        self.owner.clear()
        self.pool = None
        if reg is not None and d.up and reg.state == "live":
            d.engine_face(lambda: d.deregister(reg))

    def come_back(self) -> None:
        self.away = False
        self.register(adopt=False)

    def on_event(self, reg: Reg, event: P.Event) -> None:
        if reg is not self.reg:
            return  # an earlier registration's event: nobody listens for it any more
        rid = event.request_id
        if event.kind == "done_recving":
            rec = self.pulls.pop(rid, None)
            if rec is None:
                return
            self.give_back(rec, scribble=False)
        else:
            pub = self.pubs.pop(rid, None)
            if pub is not None:
                pub.ended = True
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
        self.regs: list[Reg] = []
        self.svc = Services(self, sim.cfg)
        self.producer = SimProducer(self.svc)  # type: ignore[arg-type]
        self.producer.daemon = self
        self.drivers: dict[tuple[str, str], SimDriver] = {}
        self.remotes: dict[tuple[str, str], RemoteEngine] = {}
        self.pending: dict[int, Request] = {}
        self.xfers: set[int] = set()
        self.q_pulls = self.q_bytes = 0
        self.face_s = 0.0
        self.lost: set[int] = set()  # daemons whose connection liveness lost
        self.dead_seen: set[str] = set()  # incarnations whose connections were reset
        sim.agents[self.agent] = self
        self.after(HOUSEKEEPING_S, self.housekeeping)

    # scheduling: nothing of a daemon runs while it is frozen, nothing survives its crash

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.sim.after(delay_s, self._run, self.inc, fn, args)

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

    def deregister(self, reg: Reg) -> None:
        if self.svc.registry.engines.get(reg.engine_id) is reg:
            del self.svc.registry.engines[reg.engine_id]
        reg.state = "retired"
        self.svc.registry.gone(reg.engine_id)

    def housekeeping(self) -> None:
        sim = self.sim
        self.producer.expire(sim.now)
        for reg in self.regs:
            if reg.state == "retired" and reg.rank.pins == 0:
                reg.state = "freed"
            if reg.rank.pins < 0:
                sim.violate(f"{reg} has negative pins")
        self.regs = [r for r in self.regs if r.state != "freed"]
        sim.check_bounds(self)
        self.after(HOUSEKEEPING_S, self.housekeeping)

    # peer face: requests from other daemons

    def on_request(self, src: Daemon, req: Request) -> None:
        msg, prod = req.msg, self.producer
        self.sim.note(f"{self.instance} <- {req.instance} {type(msg).__name__} "
                      f"{getattr(msg, 'request_id', '')}")
        try:
            if isinstance(msg, P.Hello):
                reg = self.svc.registry.get(msg.remote_engine_id)
                self.reply(src, req, ("hello", self.agent, reg.epoch, reg.uid))
            elif isinstance(msg, P.Acquire):
                if prod.acquire_must_wait(msg):
                    self._acquire_later(src, req)
                else:
                    self.reply(src, req, prod.acquire(msg, req.instance))
            elif isinstance(msg, P.Heartbeat):
                self.reply(src, req, prod.heartbeat(msg))
            elif isinstance(msg, P.Abandon):
                self.reply(src, req, prod.abandon(msg, req.instance))
            elif isinstance(msg, P.ReadNotice):
                prod.on_notice(msg, req.instance)
                self.reply(src, req, P.Ok())
            else:
                raise AssertionError(msg)
        except KvdError as exc:
            self.reply(src, req, exc)

    def _acquire_later(self, src: Daemon, req: Request) -> None:
        """Producer.acquire_when_published, on sim time: up to ACQUIRE_WAITS_FOR_PUBLISH_S
        for the Publish; an Abandon meanwhile refuses it."""
        msg, prod = req.msg, self.producer
        key = (msg.producer_engine_id, msg.request_id)
        state = {"done": False}

        def done(published: bool | None) -> None:
            if state["done"]:
                return
            state["done"] = True
            waiting = prod._unpublished.get(key, [])
            if entry in waiting:
                waiting.remove(entry)
            if not waiting:
                prod._unpublished.pop(key, None)
            try:
                if published is False:
                    raise NotFoundError(f"request {msg.request_id!r}: its consumer abandoned "
                                        "it before it was published")
                self.reply(src, req, prod.acquire(msg, req.instance))
            except KvdError as exc:
                self.reply(src, req, exc)

        fut = FakeFuture(lambda v: self.after(0.0, done, v))
        entry = (msg.consumer_engine_id, fut)
        prod._unpublished.setdefault(key, []).append(entry)
        self.after(min(ACQUIRE_WAITS_FOR_PUBLISH_S, self.sim.cfg.handshake_timeout_s / 4),
                   done, None)

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

    def start_pull(self, rec: PullRec, msg: P.Pull) -> None:
        """Consumer.start: refuse cheaply, or queue and drive."""
        sim = self.sim
        reg = self.svc.registry.engines.get(msg.engine_id)
        try:
            if reg is None:
                raise NotFoundError(f"engine {msg.engine_id!r} is not registered")
            if (msg.engine_id, msg.request_id) in self.drivers:
                raise KvdError(f"request {msg.request_id!r} is already being pulled")
            if len(self.drivers) >= sim.cfg.max_inflight_pulls:
                raise BusyError("pulls in flight (max_inflight_pulls)")
        except KvdError:
            rec.outcome, rec.outcome_s = "refused", sim.now
            rec.consumer.pulls.pop(rec.request_id, None)
            rec.consumer.give_back(rec, scribble=False)
            return
        rec.accepted = True
        producer = sim.by_addr.get(msg.remote_address)
        host = (producer is not None and producer is not self
                and {self.index, producer.index} <= set(sim.knobs.host_daemons))
        pull = M.Pull(msg=msg, started_s=sim.now, path=Path.HOST if host else Path.REMOTE,
                      liveness_timeout_s=sim.cfg.peer_liveness_timeout_s,
                      transfer_timeout_s=sim.cfg.transfer_timeout_s)
        drv = SimDriver(self, pull, rec, reg)
        self.drivers[pull.key] = drv
        cached = self.remotes.get((msg.engine_id, msg.remote_engine_id))
        if cached is not None and msg.remote_address not in cached.daemons:
            cached = None
        drv.start(cached)


# ------------------------------------------------------------------ the network


@dataclass(eq=False)
class Request:
    rid: int
    src: Daemon
    dst: Daemon
    msg: Any
    then: Callable[[Reply | KvdError], None]
    instance: str  # the sender's incarnation (the header's instance)
    dst_instance: str = ""


class Network:
    """Control messages between daemons: delays, partitions and the faults of ``msg``
    windows; every request has a timeout; liveness notices silent peers."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.ids = itertools.count(1)
        self.last: dict[tuple[str, str], float] = {}  # the last delivery per connection

    def _delay(self, a: int, b: int) -> list[float]:
        """Delivery delays of one message from a to b ([]: dropped, two: duplicated)."""
        rng = self.sim.net_rng
        base = rng.uniform(0.0001, 0.001)
        kind = self.sim.msg_fault(a, b)
        if kind is None or rng.random() < 1.0 - self.sim.knobs.msg_fault_p:
            return [base]
        if kind == "drop":
            return []
        if kind == "delay":
            return [base + rng.uniform(0.05, 1.5)]
        if kind == "dup":
            return [base, base + rng.uniform(0.0, 0.3)]
        return [base + rng.uniform(0.0, 0.05)]  # reorder: later ones may overtake it (not fifo)

    def request(self, src: Daemon, addr: str, msg: Any, timeout_s: float,
                then: Callable[[Reply | KvdError], None]) -> None:
        dst = self.sim.by_addr[addr]
        req = Request(next(self.ids), src, dst, msg, then, src.instance, dst.instance)
        src.pending[req.rid] = req
        src.after(timeout_s, self._timeout, src, req)
        for delay in self._delay(src.index, dst.index):
            self._carry(src.index, dst.index, delay, self._arrive, dst, dst.inc, req)

    def _carry(self, a: int, b: int, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Deliver after ``delay``; across a partition, once it heals (TCP retransmits),
        unless liveness gave the connection up meanwhile (ZMQ then drops its queue)."""
        sim = self.sim
        sent_s = sim.now
        if sim.knobs.fifo:  # one connection per incarnation pair: TCP keeps its order
            key = (sim.daemons[a].instance, sim.daemons[b].instance)
            at = max(sim.now + delay, self.last.get(key, 0.0) + 1e-6)
            self.last[key] = at
            delay = at - sim.now

        def hop() -> None:
            heal = sim.partition_heals(a, b)
            if heal is not None:
                sim.at(heal + 0.001, hop)
                return
            if sim.now - sent_s >= sim.cfg.peer_liveness_timeout_s and sim.was_partitioned(
                    a, b, sent_s):
                return
            fn(*args)

        sim.after(delay, hop)

    def _arrive(self, dst: Daemon, inc: int, req: Request) -> None:
        if not dst.up or dst.inc != inc:  # its connection died with it
            return
        dst.after(0.0, dst.on_request, req.src, req)

    def send_reply(self, dst: Daemon, src: Daemon, req: Request, body: Any) -> None:
        inc = src.inc
        instance = dst.instance
        for delay in self._delay(dst.index, src.index):
            self._carry(dst.index, src.index, delay, self._answer, src, inc, req, body,
                        instance)

    def _answer(self, src: Daemon, inc: int, req: Request, body: Any, instance: str) -> None:
        if src.inc != inc or not src.up or instance in src.dead_seen:
            return
        src.after(0.0, self._answered, src, req, body, instance)

    def _answered(self, src: Daemon, req: Request, body: Any, instance: str) -> None:
        self.sim.note(f"{src.instance} <- {instance} {type(req.msg).__name__} reply "
                      f"{type(body).__name__}")
        if src.pending.pop(req.rid, None) is None:
            return  # timed out, lost, or a duplicate
        if isinstance(body, KvdError):
            req.then(body)
        else:
            req.then(Reply(body, instance, self.sim.now))

    def _timeout(self, src: Daemon, req: Request) -> None:
        if src.pending.pop(req.rid, None) is None:
            return
        src.drop_address(req.dst.addr)  # no answer: what we cached about it goes
        req.then(KvdTimeoutError(f"no answer from {req.dst.addr}"))


# ------------------------------------------------------------------ the pull's driver


class SimDriver:
    """kvd.daemon.pull.driver.PullDriver on sim time: the same action semantics.

    ``self.token`` names the one wait the pull is in; cancelling (the deadline) bumps it,
    so a continuation of a cancelled wait does nothing."""

    def __init__(self, d: Daemon, pull: M.Pull, rec: PullRec, reg: Reg) -> None:
        self.d = d
        self.sim = d.sim
        self.pull = pull
        self.rec = rec
        self.reg = reg
        self.token = 0
        self.in_end = False
        self.reported = False
        self.acq: dict[str, Reply | KvdError | None] | None = None
        self.acq_from: RemoteEngine | None = None
        self.acq_waiting = False
        self.beating = False
        self.acq_token = 0
        self.acq_rest: list[M.Action] = []
        self.pending_acts: list[M.Action] = []
        self.polled = False  # carrying out the first action after a poll

    # plumbing

    def later(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Continue in ``delay_s`` unless the wait is cancelled meanwhile."""
        token = self.token

        def go() -> None:
            if self.token == token:
                fn(*args)

        self.d.after(delay_s, go)

    def start(self, cached: RemoteEngine | None) -> None:
        pull, sim = self.pull, self.sim
        self.d.after(max(0.0, pull.transfer_timeout_s - (sim.now - pull.started_s)),
                     self._deadline)
        self.go(pull.handle(Begin(cached, pull.path), sim.now))

    def _deadline(self) -> None:
        if self.reported or self.in_end or self.pull.ending:
            return
        self.token += 1  # cancels whatever the pull waits for
        self.acq_waiting = False
        self.go(self.pull.handle(Interrupted(deadline=True), self.sim.now))

    def go(self, acts: list[M.Action]) -> None:
        try:
            while acts:
                if self.pull.ending:
                    self.in_end = True
                act, acts = acts[0], acts[1:]
                if self.sim.trace is not None:
                    self.sim.note(f"{self.d.instance} {self.rec.label} [{self.pull.state.value}] "
                                  f"{type(act).__name__} {getattr(act, 'delay_s', '')}")
                more = self.do(act, acts)
                if more is None:
                    return  # waiting: the continuation carries ``acts`` on
                acts = more + acts
        except KvdError as exc:  # an exception in the task: the pull fails with it
            if self.in_end:
                raise
            self.fail_with(exc, [])

    def resume(self, more: list[M.Action], rest: list[M.Action]) -> None:
        self.go(more + rest)

    def wait(self) -> None:
        """The action waits: its continuation goes on with the actions after it."""

    def fail_with(self, exc: KvdError, rest: list[M.Action]) -> None:
        self.token += 1
        self.acq_waiting = False
        self.go(self.pull.handle(Raised(exc), self.sim.now))

    # the actions

    def do(self, act: M.Action, rest: list[M.Action]) -> list[M.Action] | None:
        pull, d, sim = self.pull, self.d, self.sim
        if isinstance(act, M.KeepLeases):
            self.renew()
            return []
        polled, self.polled = self.polled, False
        if isinstance(act, M.WaitRanks):  # as PullDriver's: the same registration, or fail
            reg = d.svc.registry.engines.get(pull.msg.engine_id)
            if reg is None:
                raise NotFoundError(f"engine {pull.msg.engine_id!r} is not registered")
            again, self.reg = reg is not self.reg, reg  # as PullDriver: the machine judges
            return pull.handle(RanksReady(again), sim.now)
        if isinstance(act, M.Greet):
            self.greet(rest)
            self.wait()
            return None
        if isinstance(act, M.SendAcquire):
            self.send_acquire()
            return pull.handle(AcquireSent(), sim.now)
        if isinstance(act, M.Assemble):
            return self.assemble()
        if isinstance(act, M.Post):
            if not act.again and (d.q_pulls >= sim.cfg.max_quarantined_pulls):  # check_room
                raise BusyError("pulls are quarantined (max_quarantined_pulls)")
            self.pin()
            results = sim.transport.post(d, list(act.posts), self.rec, self.reg,
                                         host=pull.path == "host")
            return pull.handle(Posted(results, sim.now, 0.0), sim.now)
        if isinstance(act, M.AwaitReplies):
            got = self.replies()
            if got is None:
                self.acq_waiting = True
                self.acq_token = self.token
                self.acq_rest = rest
                self.wait()
                return None
            return pull.handle(RepliesIn(list(self.acq or {}), got), sim.now)
        if isinstance(act, M.PollAfter):
            self.wait()
            self.later(act.delay_s, self._polled, rest)
            return None
        if isinstance(act, M.Probe):
            self.probe(act, rest)
            self.wait()
            return None
        if isinstance(act, M.Discard):  # every transfer ended
            if polled:  # released in the poll's own step
                self.release()
                return pull.handle(Discarded(), sim.now)
            self.wait()
            self.later(0.0, self._discarded, rest)
            return None
        if isinstance(act, M.Sever):
            for agent, addrs in act.producers.items():
                sim.transport.sever(d, agent)
                for a in addrs:
                    d.drop_address(a)
            return []
        if isinstance(act, M.Release):
            self.release()
            return pull.handle(Released(), sim.now)
        if isinstance(act, M.Report):
            self.report(act)
            return []
        if isinstance(act, M.Warn):
            return []
        if isinstance(act, M.Quarantine):
            sign = 1 if act.enter else -1
            d.q_pulls += sign
            d.q_bytes += sign * act.nbytes
            return []
        if isinstance(act, M.ForgetHandshake):
            d.remotes.pop((pull.msg.engine_id, pull.msg.remote_engine_id), None)
            return []
        if isinstance(act, M.Confirm):  # as HostMaps.owner_gone: the owner still alive?
            return pull.handle(Confirmed(self.owner_gone()), sim.now)
        raise AssertionError(act)

    def owner_gone(self) -> str:
        for h in self.pull.handles:
            x = self.sim.transport.xfers[h]
            owner = self.sim.agents.get(x.agent)
            if owner is None or not owner.up or owner.agent != x.agent:
                return f"the producer daemon {x.agent} died or restarted during the copy"
        return ""

    def _polled(self, rest: list[M.Action]) -> None:
        pull, sim = self.pull, self.sim
        states = sim.transport.poll(sorted(pull.live))
        unreachable = self.d.unreachable(list(pull.remote.daemons) if pull.remote else [])
        acts = pull.handle(Polled(states, unreachable), sim.now)
        self.polled = True  # for the first of ``acts`` (`do`)
        self.resume(acts, rest)

    def _discarded(self, rest: list[M.Action]) -> None:
        self.release()
        self.resume(self.pull.handle(Discarded(), self.sim.now), rest)

    # the parts

    def greet(self, rest: list[M.Action]) -> None:
        pull, d = self.pull, self.d
        msg = pull.msg
        key = (msg.engine_id, msg.remote_engine_id)
        cached = d.remotes.get(key)
        if cached is not None and msg.remote_address in cached.daemons:
            self.later(0.0, lambda: self.resume(
                pull.handle(Greeted(cached, pull.path), self.sim.now), rest))
            return
        d.remotes.pop(key, None)
        addr = msg.remote_address
        if d.unreachable([addr]):
            self.later(KNOWN_DEAD_WAIT_S, self.fail_with,
                       PeerLostError(f"{addr} is unreachable"), rest)
            return
        token = self.token
        hello = P.Hello(daemon_id=d.name, remote_engine_id=msg.remote_engine_id,
                        consumer=None, agent_metadata=b"", compat_hash="")  # type: ignore[arg-type]

        def answered(r: Reply | KvdError) -> None:
            if self.token != token:
                return
            if isinstance(r, KvdError):
                self.fail_with(r, rest)
                return
            _, agent, epoch, pool_uid = r.body
            remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type]
                addr: RemoteDaemon(addr, agent=agent, instance=r.instance, epoch=epoch)},
                pools=pool_uid)
            d.remotes[key] = remote
            self.resume(pull.handle(Greeted(remote, pull.path), self.sim.now), rest)

        d.request(addr, hello, None, answered)

    def send_acquire(self) -> None:
        pull, d = self.pull, self.d
        remote = pull.remote
        assert remote is not None
        if self.acq is not None and self.acq_from is remote:
            return
        msg = P.Acquire(request_id=pull.msg.producer_request_id,
                        producer_engine_id=pull.msg.remote_engine_id,
                        consumer_engine_id=pull.msg.engine_id,
                        block_ids=list(pull.msg.remote_block_ids))
        acq: dict[str, Reply | KvdError | None] = {a: None for a in remote.daemons}
        self.acq, self.acq_from = acq, remote
        for addr in remote.daemons:
            def got(r: Reply | KvdError, addr: str = addr) -> None:
                acq[addr] = r
                if (self.acq is acq and self.acq_waiting and self.token == self.acq_token
                        and self.replies() is not None):
                    self.acq_waiting = False
                    self.resume(self.pull.handle(RepliesIn(list(acq), self.replies()),  # type: ignore
                                                 self.sim.now), self.acq_rest)
            d.request(addr, msg, None, got)

    def replies(self) -> list[Reply | BaseException] | None:
        if self.acq is None or any(v is None for v in self.acq.values()):
            return None
        return list(self.acq.values())  # type: ignore[arg-type]

    def assemble(self) -> list[M.Action]:
        pull, rec = self.pull, self.rec
        if not self.reg.live_ranks():
            return pull.handle(AssemblyFailed(f"{KvdError.code}: engine "
                                              f"{pull.msg.engine_id!r} left before its READs "
                                              "were posted"), self.sim.now)
        remote = pull.remote
        assert remote is not None
        (addr,) = remote.daemons
        agent = remote.daemons[addr].agent
        n = len(rec.local_blocks)
        nbytes = n * self.sim.knobs.block_bytes
        if rec.big:  # nominally past EARLY_POST_MAX_BYTES: posted after the replies
            nbytes = n * (M.EARLY_POST_MAX_BYTES // 2 + 1)
        post = ReadPost(peer=agent, local_addrs=np.array(pull.msg.local_block_ids, np.uint64),
                        remote_addrs=np.array([remote.pools * POOL_SPAN + b
                                               for b in pull.msg.remote_block_ids], np.uint64),
                        nbytes=np.full(n, self.sim.knobs.block_bytes, np.uint64),
                        mem_type="DRAM", notif=b"")
        notice = (agent, P.ReadNotice(request_id=pull.msg.producer_request_id,
                                      producer_engine_id=pull.msg.remote_engine_id,
                                      consumer_engine_id=pull.msg.engine_id, reads=1,
                                      nbytes=nbytes))
        return pull.handle(Assembled([post], [notice], nbytes, n, self.replies() is not None),
                           self.sim.now)

    @property
    def engine(self) -> Reg:  # what PullDriver._pin and _unpin read
        return self.reg

    def pin(self) -> None:
        PullDriver._pin(self)  # type: ignore[arg-type] - the real one: it decides what is pinned

    def unpin(self) -> None:
        if self.pull.handles:
            self.sim.violate(f"{self.rec.label} unpinned with transfer handles not released")
        PullDriver._unpin(self)  # type: ignore[arg-type]

    def release(self) -> None:
        pull = self.pull
        if pull.handles:
            for h in pull.handles:
                if self.sim.transport.xfers[h].state is XferState.PENDING and \
                        pull.cancel_reason is None:
                    self.sim.violate(f"{self.rec.label} released transfer {h} while it runs")
            handles, pull.handles = pull.handles, []
            self.sim.transport.release(self.d, handles)
        self.unpin()

    def probe(self, act: M.Probe, rest: list[M.Action]) -> None:
        """As PullDriver: drop the cached daemons (the first probe), then ask this one."""
        d, pull = self.d, self.pull
        for addr in act.drop:
            d.drop_address(addr)
        addr = act.address
        unreachable = d.unreachable([addr])
        token = self.token

        def answer(reply: Reply | None) -> None:
            self.resume(pull.handle(Probed(addr, reply), self.sim.now), rest)

        def ask() -> None:
            if addr in unreachable:
                answer(None)
                return

            def got(r: Reply | KvdError) -> None:
                if self.token == token:
                    answer(None if isinstance(r, KvdError) else r)

            d.request(addr, P.Heartbeat(producer_engine_id=pull.msg.remote_engine_id,
                                        request_ids=[]),
                      min(PROBE_TIMEOUT_S, self.sim.cfg.handshake_timeout_s), got)

        if act.drop:
            self.later(0.0, ask)
        else:
            ask()

    def renew(self) -> None:
        if not self.beating:
            self.beating = True
            self.d.after(self.sim.cfg.heartbeat_interval_s, self._beat)

    def _beat(self) -> None:
        """One round of _beat: heartbeats to each producer, one after the other."""
        pull, d = self.pull, self.d
        if self.reported:
            return
        addrs = pull.lease_addresses()  # none while nothing needs renewing
        beat = P.Heartbeat(producer_engine_id=pull.msg.remote_engine_id,
                           request_ids=[pull.msg.producer_request_id])

        def step(i: int) -> None:
            if self.reported:
                return
            if i == len(addrs):
                d.after(self.sim.cfg.heartbeat_interval_s, self._beat)
                return

            def got(r: Reply | KvdError) -> None:
                if self.reported:
                    return
                if not isinstance(r, KvdError):
                    pull.handle(LeaseReply(addrs[i], r), self.sim.now)
                step(i + 1)

            d.request(addrs[i], beat, None, got)

        step(0)

    def report(self, act: M.Report) -> None:
        d, sim, rec = self.d, self.sim, self.rec
        if self.reported:
            sim.violate(f"{rec.label} reported twice")
        self.reported = True
        d.drivers.pop(self.pull.key, None)
        sim.on_outcome(rec, "ok" if act.event.ok else "failed", self.pull)
        if act.event.ok:
            if rec.expected is None:
                sim.violate(f"{rec.label} of a request never published reported ok")
            elif not np.array_equal(self.reg.pool[rec.local_blocks], rec.expected):
                sim.violate(f"{rec.label} reported ok with wrong bytes")
        d.deliver_event(self.pull.msg.engine_id, act.event)
        msg = self.pull.msg
        for addr in act.abandon:
            d.request(addr, P.Abandon(request_id=msg.producer_request_id,
                                      producer_engine_id=msg.remote_engine_id,
                                      consumer_engine_id=msg.engine_id), None, lambda r: None)
        assert self.pull.remote is not None or not act.notices
        for agent, notice in act.notices:
            addrs = [a for a, dd in self.pull.remote.daemons.items()  # type: ignore[union-attr]
                     if dd.agent == agent]
            if addrs:
                d.request(addrs[0], notice, None, lambda r: None)


# ------------------------------------------------------------------ the simulation


class Sim:
    def __init__(self, seed: int, faults: list[Fault] | None = None,
                 knobs: Knobs | None = None) -> None:
        self.seed = seed
        self.knobs = knobs = knobs or Knobs()
        self.cfg = knobs.config()
        self.faults = fault_schedule(seed, knobs) if faults is None else list(faults)
        self.work_rng = random.Random(f"work-{seed}")
        self.net_rng = random.Random(f"net-{seed}")
        self.data_rng = np.random.default_rng(seed)
        self.big_rng = random.Random(f"big-{seed}")
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.epochs = itertools.count(1)
        self.uids = itertools.count(1)
        self.agents: dict[str, Daemon] = {}
        self.regs: dict[int, Reg] = {}
        self.transport = Transport(self)
        self.net = Network(self)
        self.pulls: list[PullRec] = []
        self.pubs: list[PubRec] = []
        self.frozen_spans: dict[int, list[tuple[float, float]]] = {}
        self.frozen_at: dict[int, float] = {}
        self.unreachable_since: dict[tuple[int, int], float | None] = {}
        self.trace: list[str] | None = None  # set to [] to record what happens
        self.events = 0
        self.daemons = [Daemon(self, i) for i in range(knobs.daemons)]
        self.by_addr = {d.addr: d for d in self.daemons}
        for d in self.daemons:
            for j in range(2):
                e = SimEngine(self, d, f"e{d.index}{j}")
                d.engines.append(e)
                e.register(adopt=False)
        self._plan_work()
        for f in self.faults:
            self.at(f.at_s, self._inject, f)

    # the clock

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    def run(self) -> Sim:
        end = self.knobs.end_s
        while self._heap and self._heap[0][0] <= end:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn(*args)
        self.now = end
        self.check_quiescent()
        return self

    def note(self, what: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.now:9.4f} {what}")

    def violate(self, what: str) -> None:
        raise Violation(f"t={self.now:.4f}s: {what}")

    # the work

    def _plan_work(self) -> None:
        rng, k = self.work_rng, self.knobs
        for _ in range(k.ops):
            t = rng.uniform(0.0, k.horizon_s)
            self.at(t, self._transfer, rng.random(), rng.random(), rng.random(),
                    rng.randint(1, 3), rng.random(), rng.random())

    def _engines(self) -> list[SimEngine]:
        return [e for d in self.daemons for e in d.engines]

    def _transfer(self, r1: float, r2: float, r3: float, n: int, r4: float, r5: float) -> None:
        engines = self._engines()
        prod = engines[int(r1 * len(engines))]
        others = [e for e in engines if e.daemon is not prod.daemon]
        cons = [others[int(r2 * len(others))]]
        if r5 < 0.15:  # two consumer engines read the one publish
            more = [e for e in others if e is not cons[0]]
            cons.append(more[int(r4 * len(more))])
        rid = f"r{next(self.uids)}"
        never = r3 < 0.08  # a pull of a request nobody published
        if not never:
            pub = self.publish(prod, rid, n, consumers=len(cons))
            if pub is None:
                return
        for i, c in enumerate(cons):
            delay = 0.0 if r4 < 0.25 else r4 * 0.05 * (i + 1)
            self.at(self.now + delay, self.pull, c, prod, rid, n, never)
            if r3 > 0.9 and not never:  # the engine retries a failed pull once
                self.at(self.now + delay + 1.5, self.pull, c, prod, rid, n, never, True)

    def publish(self, e: SimEngine, rid: str, n: int, consumers: int) -> PubRec | None:
        d, reg = e.daemon, e.reg
        free = e.free_blocks()
        if reg is None or e.away or len(free) < n or not d.up:
            return None
        blocks = free[:n]
        pub = PubRec(next(self.uids), e, rid, blocks, reg)
        for b in blocks:
            e.owner[b] = pub
        assert e.pool is not None
        e.pool[blocks] = self.data_rng.integers(0, 256, (n, self.knobs.block_bytes), np.uint8)
        pub.expected = e.pool[blocks].copy()
        e.pubs[rid] = pub
        self.pubs.append(pub)

        def handle() -> None:
            try:
                published = d.producer.publish(P.Publish(
                    engine_id=e.name, request_id=rid, block_ids=blocks, consumers=consumers))
                pub.receipt = published.receipt
            except KvdError:
                e.pubs.pop(rid, None)
                e.give_back(pub, scribble=True)

        d.engine_face(handle)
        return pub

    def pull(self, c: SimEngine, prod: SimEngine, rid: str, n: int, never: bool,
             retry: bool = False) -> None:
        d = c.daemon
        if c.reg is None or c.away or not d.up or rid in c.pulls:
            return
        if retry and not any(p.request_id == rid and p.consumer is c and p.outcome == "failed"
                             for p in self.pulls):
            return
        free = c.free_blocks()
        pub = next((p for p in self.pubs if p.engine is prod and p.request_id == rid), None)
        if len(free) < n or (pub is None and not never):
            return
        local = free[:n]
        remote_blocks = pub.blocks if pub is not None else list(range(n))
        expected = pub.expected if pub is not None else None
        rec = PullRec(next(self.uids), c, d, d.inc, rid, prod.name, rid, local, expected,
                      self.now, (prod.daemon.instance, prod.name, rid))
        rec.big = self.big_rng.random() < 0.3
        for b in local:
            c.owner[b] = rec
        c.pulls[rid] = rec
        self.pulls.append(rec)
        msg = P.Pull(engine_id=c.name, request_id=rid, remote_engine_id=prod.name,
                     remote_address=prod.daemon.addr, remote_block_ids=remote_blocks,
                     local_block_ids=local,
                     publish_receipt=pub.receipt if pub is not None and self.work_rng.random()
                     < 0.5 else "")
        d.engine_face(lambda: d.start_pull(rec, msg))

    # outcomes and invariants

    def on_outcome(self, rec: PullRec, outcome: str, pull: M.Pull) -> None:
        if rec.outcome:
            self.violate(f"{rec.label} got a second outcome ({rec.outcome}, then {outcome})")
        rec.outcome, rec.outcome_s = outcome, self.now
        took = self.now - rec.started_s - self.frozen_during(rec.daemon.index, rec.started_s,
                                                              self.now)
        # the deadline, or a failure just before it whose READ then gets the liveness
        # timeout to end on its own before it is severed; a probe and polls on top
        bound = self.cfg.transfer_timeout_s + self.cfg.peer_liveness_timeout_s + 0.6
        if took > bound:
            self.violate(f"{rec.label} took {took:.3f}s of its daemon's time (bound "
                         f"{bound:.1f}s)")
        if pull.state not in (PullState.DONE, PullState.FAILED):
            self.violate(f"{rec.label} reported in state {pull.state.value}")

    def frozen_during(self, d: int, t0: float, t1: float) -> float:
        total = 0.0
        for a, b in self.frozen_spans.get(d, []):
            total += max(0.0, min(b, t1) - max(a, t0))
        return total

    def check_hold_end(self, d: Daemon, held: Any, outcome: str) -> None:
        """A hold ends exactly when its consumers are done, its lease ran out, or its
        engine left (or every consumer abandoned it); and when it ends on a consumer's
        word, no READ of it is still running."""
        what = f"hold {held.engine_id}:{held.request_id} on {d.instance}"
        if outcome == "ok":
            if held.state is not HeldState.DONE or len(held.consumers_done) < held.consumers:
                self.violate(f"{what} ended ok before its consumers were done")
        elif outcome == "expired":
            if self.now < held.deadline_s:
                self.violate(f"{what} expired before its lease ran out")
        elif outcome == "cancelled":
            gone = d.svc.registry.engines.get(held.engine_id) is None
            if not (held.state is HeldState.RELEASED or (gone and held.state is HeldState.HELD)):
                self.violate(f"{what} cancelled in state {held.state.value} with its engine "
                             f"{'gone' if gone else 'registered'}")
        if outcome == "ok":  # on the word of every consumer: none of theirs still reads
            key = (d.instance, held.engine_id, held.request_id)
            for x in self.transport.xfers.values():
                reader = held.readers.get(x.pull.consumer.name)
                if (x.hold_key == key and x.state is XferState.PENDING and reader is not None
                        and reader.instance == x.consumer.instance
                        and x.consumer.inc == x.consumer_inc and x.consumer.up):
                    self.violate(f"{what} ended ok while {x.pull.label}'s READ of it still "
                                 "runs")

    def check_bounds(self, d: Daemon) -> None:
        cfg = self.cfg
        if len(d.producer.held) > cfg.max_held_requests:
            self.violate(f"{d.instance} holds {len(d.producer.held)} requests")
        if len(d.drivers) > cfg.max_inflight_pulls:
            self.violate(f"{d.instance} runs {len(d.drivers)} pulls")
        # max_quarantined_pulls refuses new posts once reached; pulls posted before may
        # still fail into the quarantine, which stays within the pulls in flight
        if not 0 <= d.q_pulls <= min(cfg.max_inflight_pulls, len(d.drivers)):
            self.violate(f"{d.instance} has {d.q_pulls} quarantined pulls of "
                         f"{len(d.drivers)} in flight")
        if len(d.remotes) > 4 * len(self._engines()) ** 2:
            self.violate(f"{d.instance} caches {len(d.remotes)} handshakes")
        if len(d.pending) > 10_000:
            self.violate(f"{d.instance} has {len(d.pending)} requests pending")

    def check_quiescent(self) -> None:
        for rec in self.pulls:
            if not rec.outcome:
                if rec.daemon.inc != rec.inc:
                    rec.outcome = "lost"  # its daemon died: the engine heard on_lost
                    continue
                self.violate(f"{rec.label} never got an outcome (started "
                             f"{rec.started_s:.3f}s)")
        for d in self.daemons:
            if not d.up:
                continue
            if d.producer.held.items:
                self.violate(f"{d.instance} still holds {list(d.producer.held.items)}")
            if d.producer._pinned or d.producer._reading or d.producer._unpublished:
                self.violate(f"{d.instance}: producer tables not empty")
            if d.drivers:
                self.violate(f"{d.instance} still runs pulls {list(d.drivers)}")
            if d.q_pulls or d.q_bytes:
                self.violate(f"{d.instance} still counts {d.q_pulls} quarantined pulls")
            for reg in d.regs:
                if reg.rank.pins:
                    self.violate(f"{reg} still pinned")
                if reg.state == "retired":
                    self.violate(f"{reg} retired but never freed")
            if d.pending:
                self.violate(f"{d.instance} still waits for {len(d.pending)} replies")
            for key, remote in d.remotes.items():
                for rd in remote.daemons.values():
                    if rd.instance != self.by_addr[rd.address].instance:
                        self.violate(f"{d.instance} caches {key} of a dead incarnation "
                                     f"{rd.instance}")
        for x in self.transport.xfers.values():
            if not x.released and x.consumer.inc == x.consumer_inc and x.consumer.up:
                self.violate(f"transfer {x.id} of {x.pull.label} never released")

    # faults

    def read_mode(self, d: Daemon) -> str:
        for f in self.faults:
            if f.kind == "read" and f.a == d.index and f.at_s <= self.now < f.at_s + f.dur_s:
                return f.x
        return "ok"

    def read_fault_active(self, d: Daemon, kind: str) -> bool:
        return self.read_mode(d) == kind

    def msg_fault(self, a: int, b: int) -> str | None:
        for f in self.faults:
            if (f.kind == "msg" and {a, b} == {f.a, f.b}
                    and f.at_s <= self.now < f.at_s + f.dur_s):
                return f.x
        return None

    def partition_heals(self, a: int, b: int) -> float | None:
        """When the partition between a and b that holds now heals (None: no partition)."""
        heal = None
        for f in self.faults:
            if (f.kind == "partition" and {a, b} == {f.a, f.b}
                    and f.at_s <= self.now < f.at_s + f.dur_s):
                heal = max(heal or 0.0, f.at_s + f.dur_s)
        return heal

    def was_partitioned(self, a: int, b: int, since_s: float) -> bool:
        return any(f.kind == "partition" and {a, b} == {f.a, f.b} and f.at_s < self.now
                   and f.at_s + f.dur_s > since_s for f in self.faults)

    def partitioned(self, a: int, b: int) -> bool:
        return self.partition_heals(a, b) is not None

    def _reachable(self, a: int, b: int) -> bool:
        """Whether b answers a's liveness heartbeats now."""
        db = self.daemons[b]
        return db.up and not db.frozen and not self.partitioned(a, b)

    def _reachability_changed(self) -> None:
        """Liveness: a peer silent for ``peer_liveness_timeout_s`` is lost (a dead one at
        once: its connections are reset); one that answers again is connected again."""
        for a in range(len(self.daemons)):
            for b in range(len(self.daemons)):
                if a == b:
                    continue
                ok = self._reachable(a, b)
                key = (a, b)
                since = self.unreachable_since.get(key)
                if ok:
                    self.unreachable_since[key] = None
                    self.daemons[a].lost.discard(b)
                elif since is None:
                    self.unreachable_since[key] = self.now
                    self.daemons[a].after(self.cfg.peer_liveness_timeout_s, self._liveness, a, b,
                                          self.now)

    def _liveness(self, a: int, b: int, since: float) -> None:
        if self.unreachable_since.get((a, b)) == since and b not in self.daemons[a].lost:
            self.daemons[a].on_lost(self.daemons[b])

    def _inject(self, f: Fault) -> None:
        d = self.daemons[f.a]
        if f.kind == "freeze":
            if not d.up or d.frozen:
                return
            d.frozen = True
            self.frozen_at[d.index] = self.now
            self._reachability_changed()
            self.after(f.dur_s, self._thaw, d, d.inc)
        elif f.kind == "crash":
            if not d.up:
                return
            self._crash(d, f)
        elif f.kind == "busy":
            if not d.up or d.busy:
                return
            d.busy = True
            self.after(f.dur_s, self._unbusy, d, d.inc, self.now)
        elif f.kind == "partition":
            self._reachability_changed()
            self.after(f.dur_s, self._reachability_changed)
        elif f.kind == "leave":
            e = d.engines[f.b]
            if e.away:
                return
            e.leave()
            self.after(f.dur_s, e.come_back)
        # msg and read windows are looked up when a message or READ goes

    def _unbusy(self, d: Daemon, inc: int, since: float) -> None:
        if not d.busy or d.inc != inc:
            return
        d.busy = False
        self.frozen_spans.setdefault(d.index, []).append((since, self.now))
        if not d.frozen:
            d.resume()

    def _thaw(self, d: Daemon, inc: int) -> None:
        if not d.frozen or d.inc != inc:
            return
        self.frozen_spans.setdefault(d.index, []).append((self.frozen_at[d.index], self.now))
        d.resume()
        self._reachability_changed()

    def _crash(self, d: Daemon, f: Fault) -> None:
        was_frozen = d.frozen
        if was_frozen:
            self.frozen_spans.setdefault(d.index, []).append((self.frozen_at[d.index], self.now))
        d.up = False
        d.frozen = False
        d.busy = False
        d.deferred = []
        for reg in d.regs:
            reg.state = "dead"
        for e in d.engines:
            e.lost_daemon()
        for other in self.daemons:  # its connections are reset: each peer notices when it runs
            if other is not d:
                other.after(0.001, other.conn_reset, d, d.instance)
        self._reachability_changed()
        self.after(f.dur_s, self._restart, d, f.x == "adopt")

    def _restart(self, d: Daemon, adopt: bool) -> None:
        d.start()
        for key in list(self.unreachable_since):
            if key[0] == d.index:  # the new incarnation's connections are new
                self.unreachable_since[key] = None
        self._reachability_changed()
        for e in d.engines:
            if not e.away:
                e.register(adopt=adopt)


# ------------------------------------------------------------------ replay and shrink


def run(seed: int, faults: list[Fault] | None = None, knobs: Knobs | None = None) -> Sim:
    """One run; raises `Violation` (or whatever kvd raised) on the first broken invariant."""
    return Sim(seed, faults, knobs).run()


def fails(seed: int, faults: list[Fault], knobs: Knobs | None = None) -> str | None:
    """The failure of this run, as text (None: it passed)."""
    try:
        run(seed, faults, knobs)
    except Exception as exc:  # noqa: BLE001 - any exception out of kvd is a failure too
        return f"{type(exc).__name__}: {exc}"
    return None


def shrink(seed: int, faults: list[Fault] | None = None, knobs: Knobs | None = None
           ) -> list[Fault]:
    """The shortest fault trace (1-minimal: dropping any one more fault makes the run
    pass) that still fails, by delta debugging: drop halves, then single faults."""
    knobs = knobs or Knobs()
    trace = fault_schedule(seed, knobs) if faults is None else list(faults)
    if fails(seed, trace, knobs) is None:
        raise ValueError(f"seed {seed} passes with these faults: nothing to shrink")
    n = 2
    while len(trace) >= 2:
        chunk = max(1, len(trace) // n)
        parts = [trace[i:i + chunk] for i in range(0, len(trace), chunk)]
        for i in range(len(parts)):
            rest = [f for j, p in enumerate(parts) if j != i for f in p]
            if fails(seed, rest, knobs) is not None:
                trace, n = rest, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(len(trace), n * 2)
    if len(trace) == 1 and fails(seed, [], knobs) is not None:
        trace = []
    return trace


def report(seed: int, knobs: Knobs | None = None) -> str:
    """What a failing seed prints: its failure, the full fault schedule, the shrunk one, and
    how to replay it."""
    knobs = knobs or Knobs()
    full = fault_schedule(seed, knobs)
    why = fails(seed, full, knobs)
    if why is None:
        return f"seed {seed} passes"
    small = shrink(seed, full, knobs)
    lines = [f"seed {seed} fails: {why}", f"fault schedule ({len(full)}):",
             *(f"  {f}" for f in full), f"shortest failing trace ({len(small)}): "
             f"{fails(seed, small, knobs)}", *(f"  {f!r}" for f in small),
             f"replay: KVD_SIM_SEED={seed} .venv/bin/python -m pytest -q "
             "tests/daemon/test_fleet_sim.py -k replay  (or fleet.run(seed, faults=[...]))"]
    return "\n".join(lines)

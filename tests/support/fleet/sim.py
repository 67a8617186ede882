"""The simulation: a fleet of daemons on one virtual-time loop, its work, its faults and
its invariants; `run`, `fails`, `shrink` and `report` replay and shrink a seed."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.daemon.produce.held import HeldState
from kvd.daemon.pull.machine import Pull
from kvd.daemon.pull.state import PullState
from kvd.errors import KvdError
from kvd.transport.base import XferState
from kvd.wire import protocol as P
from support.clock import VirtualLoop
from support.fleet import layouts
from support.fleet.daemon import Daemon, PubRec, PullRec, SimEngine
from support.fleet.fakes import FakeEngine
from support.fleet.faults import Fault, Knobs, Violation, fault_schedule
from support.fleet.network import Network
from support.fleet.progressive import ProgressiveWork
from support.fleet.transport import Transport


class _Errors(logging.Handler):
    """kvd's errors in the log during a run fail it: a driver logs, rather than raises, an
    exception it did not expect (a pull that crashed, one that ended without a report)."""

    sim: Sim | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.sim is not None:
            self.sim.fail(Violation(f"t={self.sim.now:.4f}s: kvd logged an error: "
                                    f"{record.getMessage()}"))


_ERRORS = _Errors(logging.ERROR)
_KVD_LOG = logging.getLogger("kvd")
_KVD_LOG.addHandler(_ERRORS)  # inert outside a run


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
        self.loop = VirtualLoop(start_s=0.0)  # the one heap: daemons, network, transport
        self.tasks: list[asyncio.Task[Any]] = []  # every daemon's (`Daemon.spawn`)
        self.failure: BaseException | None = None
        self.epochs = itertools.count(1)
        self.uids = itertools.count(1)
        self.agents: dict[str, Daemon] = {}
        self.regs: dict[int, FakeEngine] = {}
        self.transport = Transport(self)
        self.net = Network(self)
        self.pulls: list[PullRec] = []
        self.pubs: list[PubRec] = []
        self.frozen_spans: dict[int, list[tuple[float, float]]] = {}
        self.frozen_at: dict[int, float] = {}
        self.unreachable_since: dict[tuple[int, int], float | None] = {}
        self.trace: list[str] | None = None  # set to [] to record what happens
        # every engine's (kv_layout, head_layout) with engine_block_tokens (layouts)
        self.layout = layouts.draw(seed) if knobs.engine_block_tokens else None
        assert self.layout is None or knobs.ops == 0, "engine_block_tokens: progressive only"
        self.daemons = [Daemon(self, i) for i in range(knobs.daemons)]
        self.by_addr = {d.addr: d for d in self.daemons}
        for d in self.daemons:
            for j in range(2):
                e = SimEngine(self, d, f"e{d.index}{j}", 2 * d.index + j)
                d.engines.append(e)
                e.register(adopt=False)
        self._plan_work()
        self.prog = ProgressiveWork(self) if knobs.prog_ops else None
        for f in self.faults:
            self.at(f.at_s, self._inject, f)

    # the clock

    @property
    def now(self) -> float:
        return self.loop._now

    @property
    def events(self) -> int:
        """Callbacks run so far: the simulation's and the real drivers' steps."""
        return self.loop.steps

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        now = self.loop._now
        self.loop.at(t if t > now else now, fn, args)

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.loop.at(self.loop._now + delay_s, fn, args)

    def run(self) -> Sim:
        _ERRORS.sim = self
        level = _KVD_LOG.level
        _KVD_LOG.setLevel(logging.ERROR)  # during a run, only errors: the checks count
        try:
            self.loop.run_until(self.knobs.end_s)
            if self.failure is None:  # stopped when idle: time runs out with nothing to do
                self.loop._now = max(self.loop._now, self.knobs.end_s)
        finally:
            _ERRORS.sim = None
            self._bury()
            _KVD_LOG.setLevel(level)
        if self.failure is not None:
            raise self.failure
        self.check_quiescent()
        return self

    def stop_if_idle(self) -> None:
        """Stop the run early when nothing can change any more: every daemon up, holding
        nothing, pulling nothing, and no event left but their housekeeping (each tick of
        which would then find nothing to do until the end). The outcome is the same as
        running to the end, in a fraction of the events."""
        for d in self.daemons:
            if (not d.up or d.frozen or d.busy or d.deferred or d.drivers or d.pending
                    or d.producer.held.items or d.progressive or d.producer.opened.items
                    or any(r.state != "live" for r in d.regs)):
                return
        for _, _, fn, args, call in self.loop._timers:
            if call is not None or getattr(fn, "__func__", None) is not Daemon._run or \
                    getattr(args[1], "__func__", None) is not Daemon.housekeeping:
                return
        self.loop.stop()

    def _bury(self) -> None:
        """Close the tasks that will never run again (a crashed daemon's, never woken;
        those still waiting at the end), now rather than whenever they are collected
        (their `finally` blocks log that their pulls never reported: not logged)."""
        _KVD_LOG.setLevel(logging.CRITICAL + 1)  # the caller restores it
        for task in asyncio.all_tasks(self.loop):  # the daemons' and those kvd made
            if not task.done():
                task._log_destroy_pending = False  # type: ignore[attr-defined]
                try:
                    task.get_coro().close()  # type: ignore[union-attr]
                except RuntimeError:
                    pass
        self.tasks = []

    def fail(self, exc: BaseException) -> None:
        """The first broken invariant ends the run, even when raised where kvd's code
        catches it (a driver turns an exception into a failed pull)."""
        if self.failure is None:
            self.failure = exc
        self.loop.stop()

    def task_done(self, task: asyncio.Task[Any]) -> None:
        """A daemon's task ended: one that raised anything but kvd's own errors is a bug."""
        if not task.cancelled():
            exc = task.exception()
            if exc is not None and not isinstance(exc, KvdError):
                self.fail(exc)

    def note(self, what: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.now:9.4f} {what}")

    def violate(self, what: str) -> None:
        exc = Violation(f"t={self.now:.4f}s: {what}")
        self.fail(exc)
        raise exc

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

    def on_outcome(self, rec: PullRec, outcome: str, pull: Pull) -> None:
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
        if not 0 <= d.quarantine.pulls <= min(cfg.max_inflight_pulls, len(d.drivers)):
            self.violate(f"{d.instance} has {d.quarantine.pulls} quarantined pulls of "
                         f"{len(d.drivers)} in flight")
        if len(d.remotes) > 4 * (2 * len(self.daemons)) ** 2:  # two engines each
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
            if d.quarantine.pulls or d.quarantine.nbytes:
                self.violate(f"{d.instance} still counts {d.quarantine.pulls} quarantined "
                             "pulls")
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
        if self.prog is not None:
            self.prog.check_quiescent()

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

"""Carrying out a pull's actions: inline in the engine's request, then in its task.

`PullDriver.run_now` drives a fresh `Pull` (kvd.daemon.pull.machine) as far as it goes
without waiting, in the engine's request itself: with the handshake cached, a small
pull's Acquire leaves, its READ is posted and, when that READ is done and the Acquire's
replies are already here, it is reported in that same step. Whatever needs waiting (a
poll, a reply, a handshake, a large post) is left to `PullDriver.run`, the pull's task,
which goes on with the same object from the action it stopped at. One interpreter
carries the actions out: the task's `_do` is `_now` (every step that needs no wait, the
same code the inline path runs) followed, only when that cannot finish it, by `_wait`
(the awaiting part alone).

The driver decides nothing about the pull: it gathers facts (a poll's states, a reply,
whether the engine registered again, which mover a handshake gets) and feeds them to the
machine's one entry point, `Pull.handle`, whose actions it carries out next. The task
keeps the producers' leases alive while the machine says so (`KeepLeases`: heartbeats),
and owns the deadline: past ``transfer_timeout_s`` it cancels whatever the task awaits and
fails the pull. The end of a pull (quarantine, release, report) is shielded from any
further cancellation, so every pull is reported exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from kvd.daemon.engines.table import Engine
from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.acquiring import Acquiring
from kvd.daemon.pull.actions import (
    Action,
    Assemble,
    AwaitReplies,
    Confirm,
    Discard,
    ForgetHandshake,
    Greet,
    KeepLeases,
    PollAfter,
    Post,
    Probe,
    Quarantine,
    Release,
    Report,
    SendAcquire,
    Sever,
    WaitRanks,
    Warn,
)
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
from kvd.daemon.pull.machine import Pull
from kvd.daemon.pull.movers import build_posts
from kvd.daemon.pull.quarantine import QuarantineCounts
from kvd.daemon.pull.state import Path
from kvd.daemon.services import Services
from kvd.errors import KvdError, ProtocolError, TransferError
from kvd.planner.assembly import ProducerReads
from kvd.transport.base import Mover
from kvd.wire import protocol as P

log = logging.getLogger("kvd.consumer")

# After a failed READ: is the producer daemon still the same one? A heartbeat's round
# trip; short, since a partition's failure waits for it before the engine hears.
PROBE_TIMEOUT_S = 0.5

Assembler = Callable[[Pull, Engine, RemoteEngine], dict[str, ProducerReads]]
# The consumer's choice of mover for a handshake, and what the pull pins while it may
# copy (kvd.daemon.pull.hostmap.HostMaps); None: the handshake is stale, greet again.
Picker = Callable[[RemoteEngine], "tuple[Mover, Any] | None"]


class Peers(Protocol):
    """What a pull needs of the producer's daemons: kvd.daemon.peers.table.PeerTable over
    the network, kvd.daemon.pull.local.LocalPeers for this daemon's own producer side."""

    conns: Mapping[str, Any]

    def send(self, address: str, msg: object, timeout_s: float | None = None
             ) -> asyncio.Future[Reply]: ...

    async def request(self, address: str, msg: object, timeout_s: float | None = None
                      ) -> Reply: ...

    def take_ready(self, addresses: Iterable[str]) -> None: ...

    def drop_address(self, address: str, why: str) -> None: ...

    def forget(self, local_engine: str, remote_engine: str) -> None: ...

    def cached(self, engine_id: str, remote_engine: str, address: str
               ) -> RemoteEngine | None: ...

    async def remote_engine(self, engine: Engine, remote_engine: str, address: str
                            ) -> RemoteEngine: ...


class PullDriver:
    """The I/O of one pull: its mover, its Acquire on the wire, its task."""

    def __init__(self, svc: Services, pull: Pull, mover: Mover, peers: Peers,
                 quarantine: QuarantineCounts, assemble: Assembler,
                 on_reported: Callable[[Pull], None], pick: Picker | None = None) -> None:
        self.svc = svc
        self.pull = pull
        self.mover = mover
        self._pick = pick  # network pulls: the mover follows the handshake (host or NIXL)
        self._maps: Any = None  # the host mappings this pull pins (until it reported)
        self.peers = peers  # the producer's daemons (this daemon itself for a local pull)
        self.quarantine = quarantine
        self._assemble = assemble
        self._on_reported = on_reported
        self.engine: Engine | None = None
        self.acquiring: Acquiring | None = None
        self._acquired_from: RemoteEngine | None = None  # the handshake it was sent to
        self.task: asyncio.Task[None] | None = None
        self._pending: list[Action] = []
        self._heartbeat: asyncio.Task[None] | None = None
        self._timing_out = False
        self.reported = False

    # ------------------------------------------------------------ inline

    def run_now(self, engine: Engine, cached: RemoteEngine | None) -> bool:
        """Drive the pull without waiting; True when it is reported already (else start
        `run`, which goes on from where this stopped)."""
        self.engine = engine
        path = self._choose(cached) if cached is not None else None
        acts = self.pull.handle(Begin(cached, path), self.svc.clock.now())
        while acts:
            more = self._now(acts[0])
            if more is None:
                break
            acts = more + acts[1:]
        self._pending = acts
        return self.reported

    def _now(self, act: Action) -> list[Action] | None:
        """``act`` carried out now, and the pull's next actions; None when it needs waiting
        (nothing of it done)."""
        pull, svc = self.pull, self.svc
        if isinstance(act, SendAcquire):
            try:
                self._send_acquire()
            except Exception:  # noqa: BLE001 - the task sends it again, and reports its failure
                log.debug("early Acquire not sent", exc_info=True)
                return None
            return pull.handle(AcquireSent(), svc.clock.now())
        if isinstance(act, Assemble):
            return self._assembled()
        if isinstance(act, Post):
            if not self.mover.can_post_now(list(act.posts)) or not self.engine.live_ranks():
                return None  # (an engine gone: the task fails the pull, `_pin`)
            if not act.again:
                try:
                    self.quarantine.check_room(pull.nbytes)
                except KvdError:
                    return None  # the task meets it again, and reports it
            posted_s, t0 = svc.clock.now(), time.perf_counter()
            self._pin()
            results = self.mover.post_now(list(act.posts))
            if results is None:  # the NIXL lock was taken meanwhile (a thread): not posted
                self._unpin()
                return None
            return pull.handle(Posted(results, posted_s, time.perf_counter() - t0), posted_s)
        if isinstance(act, AwaitReplies):
            assert self.acquiring is not None
            got = self.acquiring.ready()
            if got is None:
                return None
            return self._replies(got)
        if isinstance(act, Release):
            if pull.handles:
                return None
            self._unpin()
            return pull.handle(Released(), svc.clock.now())
        return self._simple(act)

    def _simple(self, act: Action) -> list[Action] | None:
        """The actions that never wait; None for one that does."""
        if isinstance(act, Report):
            self._report(act)
            return []
        if isinstance(act, Warn):
            log.warning(act.text, extra={"request_id": self.pull.msg.request_id})
            return []
        if isinstance(act, Quarantine):
            (self.quarantine.enter if act.enter else self.quarantine.leave)(act.nbytes)
            return []
        if isinstance(act, KeepLeases):
            self._heartbeat = self.svc.spawn(self._beat())
            return []
        if isinstance(act, ForgetHandshake):
            msg = self.pull.msg
            self.peers.forget(msg.engine_id, msg.remote_engine_id)
            return []
        if isinstance(act, Confirm):
            gone = (self._maps.owner_gone() if self._maps is not None
                    else "no mapping of the producer's pools to confirm the copy by")
            return self.pull.handle(Confirmed(gone), self.svc.clock.now())
        return None

    # ------------------------------------------------------------ the task

    async def run(self) -> None:
        pull, clock = self.pull, self.svc.clock
        task = asyncio.current_task()
        assert task is not None
        # The deadline cancels this very task (clock.wait_for would run the pull in a task
        # of its own: two more loop turns per pull).
        timer = clock.call_later(
            max(0.0, pull.transfer_timeout_s - (clock.now() - pull.started_s)),
            lambda: self._time_out(task))
        acts = self._pending
        try:
            acts = await self._drive(acts)
        except asyncio.CancelledError:
            if self._timing_out:  # our own cancel (`_time_out`), not the daemon's
                task.uncancel()
            acts = pull.handle(Interrupted(deadline=self._timing_out), clock.now())
        except Exception as exc:  # noqa: BLE001 - never let one pull take the daemon down
            if not isinstance(exc, (KvdError, TimeoutError)):
                log.exception("pull %s crashed", pull.msg.request_id)
            acts = pull.handle(Raised(exc), clock.now())
        finally:
            timer.cancel()
        # The end: quarantine, release, report. In this same step when nothing of it needs
        # waiting (no transfer handle left: a shield would cost the pull a loop turn or
        # two); else shielded: a drain that cancels the task meanwhile makes the
        # quarantine end (cancel_reason), never skips the report.
        while acts:
            more = self._now(acts[0])
            if more is None:
                break
            acts = more + acts[1:]
        if acts:
            await asyncio.shield(self._end(acts))
        else:
            self._ended()

    def _ended(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if not self.reported:  # cannot happen: the table ends every pull with a report
            log.error("pull %s ended without a report", self.pull.msg.request_id)

    def _time_out(self, task: asyncio.Task[None]) -> None:
        if not task.done() and not self.pull.ending:
            self._timing_out = True
            task.cancel()

    async def _drive(self, acts: list[Action]) -> list[Action]:
        """Until the pull ends (its outcome is known): the actions left for the end."""
        while acts and not self.pull.ending:
            act, acts = acts[0], acts[1:]
            acts = await self._do(act) + acts
        return acts

    async def _end(self, acts: list[Action]) -> None:
        try:
            while acts:
                act, acts = acts[0], acts[1:]
                acts = await self._do(act) + acts
        finally:
            self._ended()

    async def _do(self, act: Action) -> list[Action]:
        """``act`` carried out, waiting if it must: first as `_now` would (the synchronous
        prefix, the one implementation of every step that needs no wait), then, when it
        cannot be done now, its wait (`_wait`)."""
        more = self._now(act)
        if more is not None:
            return more
        return await self._wait(act)

    async def _wait(self, act: Action) -> list[Action]:
        """The part of ``act`` that waits, for the actions `_now` could not carry out."""
        pull, svc, clock = self.pull, self.svc, self.svc.clock
        if isinstance(act, WaitRanks):
            engine = await svc.registry.complete(pull.msg.engine_id,
                                                 svc.cfg.handshake_timeout_s)
            again, self.engine = engine is not self.engine, engine
            return pull.handle(RanksReady(again), clock.now())
        if isinstance(act, Greet):
            assert self.engine is not None
            msg = pull.msg
            remote = await self.peers.remote_engine(self.engine, msg.remote_engine_id,
                                                    msg.remote_address)
            return pull.handle(Greeted(remote, self._choose(remote)), clock.now())
        if isinstance(act, SendAcquire):  # it failed now: again, raising what fails it
            self._send_acquire()
            return pull.handle(AcquireSent(), clock.now())
        if isinstance(act, Post):  # a large post, or one that must fail: see `_post`
            return await self._post(act)
        if isinstance(act, AwaitReplies):
            assert self.acquiring is not None
            return self._replies(await self.acquiring.wait())
        if isinstance(act, PollAfter):
            await clock.sleep(act.delay_s)
            states = await self.mover.poll(sorted(pull.live))
            return pull.handle(Polled(states, self._unreachable()), clock.now())
        if isinstance(act, Probe):
            for addr in act.drop:
                self.peers.drop_address(addr, "READ failed")
            return pull.handle(Probed(act.address, await self._ask(act.address)), clock.now())
        if isinstance(act, Discard):  # every transfer ended
            await self._release()
            return pull.handle(Discarded(), clock.now())
        if isinstance(act, Sever):
            await self.mover.sever(act.producers)
            return []
        if isinstance(act, Release):  # transfer handles to release first
            await self._release()
            return pull.handle(Released(), clock.now())
        raise AssertionError(f"{act} can always be carried out at once")

    # ------------------------------------------------------------ the parts

    def _choose(self, remote: RemoteEngine) -> Path | None:
        """The mover for this handshake (no transfer of the pull is out: it is chosen
        before the pull assembles, again after each greeting), and its path; pins its
        mappings, if any, until the pull reported. None: the handshake is stale."""
        if self._pick is None:
            return self.mover.path
        assert not self.pull.handles
        picked = self._pick(remote)
        if picked is None:
            return None
        mover, maps = picked
        self._unpin_maps()
        if maps is not None:
            maps.pin()
        self.mover, self._maps = mover, maps
        return mover.path

    def _unpin_maps(self) -> None:
        if self._maps is not None:
            self._maps.unpin()
            self._maps = None

    def _send_acquire(self) -> None:
        """The Acquire to every producer daemon of the handshake the pull works with (one
        already sent to that same handshake is kept)."""
        pull, svc = self.pull, self.svc
        remote, engine = pull.remote, self.engine
        assert remote is not None and engine is not None
        old = self.acquiring
        if old is not None and self._acquired_from is remote:
            return
        if old is not None:  # superseded: only its replies are collected
            svc.spawn(old.forget())
        par = engine.par
        msg = Acquiring.acquire_msg(pull.msg, par.tp_size, par.pp_size, par.layer_partition)
        self.acquiring = Acquiring({a: self.peers.send(a, msg) for a in remote.daemons},
                                   self.peers.take_ready)
        self._acquired_from = remote


    def _assembled(self) -> list[Action]:
        pull = self.pull
        assert self.engine is not None and pull.remote is not None
        try:
            groups = self._assemble(pull, self.engine, pull.remote)
        except Exception as exc:  # noqa: BLE001 - reported once the replies are in
            if not isinstance(exc, KvdError):
                log.exception("pull %s: assembly crashed", pull.msg.request_id)
            return pull.handle(AssemblyFailed(pull.describe(exc)), self.svc.clock.now())
        posts, notices, nbytes, descriptors = build_posts(pull.msg, self.engine, pull.remote,
                                                          groups)
        assert self.acquiring is not None
        return pull.handle(Assembled(posts, notices, nbytes, descriptors,
                                     self.acquiring.answered), self.svc.clock.now())

    def _replies(self, got: list[Reply | BaseException]) -> list[Action]:
        assert self.acquiring is not None
        addrs = self.acquiring.addresses
        return self.pull.handle(RepliesIn(addrs, got), self.svc.clock.now())

    async def _post(self, act: Post) -> list[Action]:
        """A post `_now` could not make: raise what refuses it (the quarantine caps, the
        engine gone), else post off the loop (a large one), noting the handles even when
        cancelled meanwhile: the transfers exist either way, and must end before the pools
        are unpinned."""
        pull, svc = self.pull, self.svc
        posts = list(act.posts)
        if not act.again:
            self.quarantine.check_room(pull.nbytes)
        posted_s, t0 = svc.clock.now(), time.perf_counter()
        self._pin()
        post = asyncio.ensure_future(self.mover.post(posts))
        try:
            results = await asyncio.shield(post)
        except asyncio.CancelledError:
            pull.handle(Posted(await post, posted_s, time.perf_counter() - t0), posted_s)
            raise
        return pull.handle(Posted(results, posted_s, time.perf_counter() - t0), posted_s)

    async def _release(self) -> None:
        pull = self.pull
        if pull.handles:
            handles, pull.handles = pull.handles, []
            await asyncio.shield(self.mover.release(handles))
        self._unpin()

    def _pin(self) -> None:
        """Pin the engine's pools for the READs about to be posted; none left (the engine
        left meanwhile, e.g. during a read-again's first READ) fails the pull: unpinned, a
        retired pool is freed under the READs that write into it."""
        assert self.engine is not None
        ranks = self.engine.live_ranks()
        if not ranks:
            raise KvdError(f"engine {self.engine.engine_id!r} left before its READs were posted")
        for r in ranks:
            r.pins += 1
            self.pull.pinned.append(r)

    def _unpin(self) -> None:
        """Only once no transfer of the pull can land any more."""
        assert not self.pull.handles, "unpinned with transfer handles not released"
        for r in self.pull.pinned:
            r.pins -= 1
        self.pull.pinned = []

    def _unreachable(self) -> frozenset[str]:
        """Producer daemons whose control connection liveness lost (ZMTP heartbeats silent
        for peer_liveness_timeout_s: dead, partitioned or frozen; or its TCP connection
        closed): a pull reading from one fails without waiting for the transport."""
        remote = self.pull.remote
        if remote is None:
            return frozenset()
        conns = self.peers.conns
        return frozenset(a for a in remote.daemons
                         if (c := conns.get(a)) is not None and c.connected is False)

    async def _ask(self, addr: str) -> Reply | None:
        """Which incarnation the producer daemon at ``addr`` is, after a failed transfer
        (None: unreachable, by liveness or by the probe's own timeout)."""
        if addr in self._unreachable():
            return None
        try:
            return await self.peers.request(addr, P.Heartbeat(
                producer_engine_id=self.pull.msg.remote_engine_id, request_ids=[]),
                min(PROBE_TIMEOUT_S, self.svc.cfg.handshake_timeout_s))
        except KvdError:
            return None

    # ------------------------------------------------------------ leases

    async def _beat(self) -> None:
        """Keep the producers' leases alive while our transfers run; notice a lost request."""
        svc, pull = self.svc, self.pull
        beat = P.Heartbeat(producer_engine_id=pull.msg.remote_engine_id,
                           request_ids=[pull.msg.producer_request_id])
        while True:
            await svc.clock.sleep(svc.cfg.heartbeat_interval_s)
            for addr in pull.lease_addresses():  # none while nothing needs renewing
                try:
                    reply = await self.peers.request(addr, beat)
                except KvdError as exc:
                    log.warning("lease heartbeat to %s failed: %s", addr, exc,
                                extra={"request_id": pull.msg.request_id, "peer": addr})
                    continue
                pull.handle(LeaseReply(addr, reply), svc.clock.now())

    # ------------------------------------------------------------ the report

    def _report(self, act: Report) -> None:
        pull, svc = self.pull, self.svc
        msg = pull.msg
        if act.abandon:
            # Our transfers are released: tell the producers not to hold the blocks for us
            # until the lease ends (best effort; the lease still bounds the hold).
            svc.spawn(self._abandon(list(act.abandon)))
        if pull.reply_to is not None:
            svc.events.answer(*pull.reply_to, act.event)
        else:
            svc.events.push(msg.engine_id, act.event)
        self.reported = True
        self._on_reported(pull)
        self._unpin_maps()  # every copy of the pull ended and was released (Release first)
        # Metrics and the log after the engine's answer (off its path); in the same loop
        # turn, so no later request sees them stale.
        m = svc.metrics
        for post_s, descriptors, timings in pull.post_records:
            m.post_duration.observe(post_s)
            m.descriptors_posted.inc(descriptors)
            m.reads_posted(timings)
        m.inflight_transfers.dec()
        m.transfer_finished("consumer", pull.outcome, pull.nbytes, act.event.duration_s,
                            pull.path)
        if not act.event.ok:
            m.invalid_blocks.inc(len(act.event.invalid_block_ids))
            log.warning("pull failed (%s): %s", pull.path, pull.error,
                        extra={"request_id": msg.request_id, "engine_id": msg.engine_id,
                               "peer": msg.remote_address})
        # The producers count our reads only now, after the engine heard (a notice is not
        # on the pull's path): every READ is done and every Acquire answered.
        for agent, notice in act.notices:
            self._notify(agent, notice)

    def _notify(self, agent: str, notice: P.ReadNotice) -> None:
        """Send a producer its ReadNotice as a peer request, not awaited (the pull is done:
        its bytes are read and the hold confirmed). Not a NIXL notification: a standalone
        one holds up the next READ on that connection until the producer progresses NIXL.
        A daemon that refuses the request (an earlier v2) gets the notification; one that
        cannot be reached releases the hold when the lease ends."""
        svc, pull = self.svc, self.pull
        assert pull.remote is not None
        addrs = [a for a, d in pull.remote.daemons.items() if d.agent == agent]
        if not addrs:
            return

        def sent(fut: asyncio.Future[Reply]) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if isinstance(exc, ProtocolError):  # "unknown message kind": an earlier v2
                svc.spawn(self._notify_by_nixl(agent, notice))
            elif exc is not None:
                svc.metrics.notifications_failed.inc()
                log.info("READ notice to %s not delivered (%s); the lease will release the "
                         "request", addrs[0], exc,
                         extra={"request_id": pull.msg.request_id, "peer": addrs[0]})

        self.peers.send(addrs[0], notice).add_done_callback(sent)

    async def _notify_by_nixl(self, agent: str, notice: P.ReadNotice) -> None:
        try:
            await self.svc.datapath.send_notif(agent, P.encode_notice(notice))
        except TransferError as exc:
            self.svc.metrics.notifications_failed.inc()
            log.info("READ notice to %s not delivered (%s); the lease will release the "
                     "request", agent, exc, extra={"request_id": self.pull.msg.request_id})

    async def _abandon(self, addrs: list[str]) -> None:
        msg = self.pull.msg
        note = P.Abandon(request_id=msg.producer_request_id,
                         producer_engine_id=msg.remote_engine_id,
                         consumer_engine_id=msg.engine_id)
        for addr in addrs:
            try:
                await self.peers.request(addr, note)
            except KvdError as exc:
                log.info("abandon to %s not delivered (%s); the lease will release it", addr,
                         exc, extra={"request_id": msg.request_id, "peer": addr})


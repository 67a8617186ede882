"""The READ phase of a pull.

`PullReads` posts one READ per producer daemon (through prepared lists where the
pools are named), polls them until done, keeps the producers' leases alive
meanwhile (heartbeats), and tells a lost or restarted producer (``peer_lost``)
from a failed READ. The pull's Acquire (`Acquiring`) travels meanwhile: the READs
do not wait for its replies, their bytes and notices do. Each producer gets its
``ReadNotice`` as a peer request once every READ is done and every Acquire
answered. The local pools stay pinned from posting until `release` has released
every transfer handle (kvd.daemon.quarantine: a failing pull's READs are made to end
first). The pull's record and its Acquire are in kvd.daemon.pull_job;
kvd.daemon.consumer drives the pull around it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import NamedTuple

from kvd.daemon.datapath import PostResult, XferState
from kvd.daemon.engines import Engine
from kvd.daemon.peerconn import Reply
from kvd.daemon.peers import RemoteEngine
from kvd.daemon.pull_job import Acquiring, PullJob, PullState
from kvd.daemon.quarantine import Quarantine
from kvd.daemon.services import Services
from kvd.errors import KvdError, PeerLostError, ProtocolError, TransferError
from kvd.planner.assembly import ProducerReads
from kvd.transport.base import PoolSpan, ReadPost
from kvd.wire import protocol as P

log = logging.getLogger("kvd.consumer")

# READ completion polling: from FIRST_POLL_S, doubling to MAX_POLL_S (a 1-block pull
# completes in well under a millisecond; a multi-GiB one takes seconds).
FIRST_POLL_S = 0.0001
MAX_POLL_S = 0.002
SPIN_POLLS = 8  # polls a loop turn apart (inline: no thread hop) before the first sleep
# READs of at most this many descriptors are posted on fresh lists: NIXL validates a
# few descriptors faster than kvd maps them onto prepared lists (and none merge).
FRESH_POST_MAX_DESCRIPTORS = 8
# Pulls of at most this many bytes post their READs before the Acquire's reply comes.
EARLY_POST_MAX_BYTES = 4 << 20
# After a failed READ: is the producer daemon still the same one? A heartbeat's round
# trip; short, since a partition's failure waits for it before the engine hears.
PROBE_TIMEOUT_S = 0.5
# A producer that no longer holds our request (or restarted) fails the pull only if the
# READ from it is still pending this long after: a producer releases the hold when our
# READ's notice arrives, which may be a moment before we see the READ done ourselves.
LOST_GRACE_S = 0.05

__all__ = ["Acquiring", "Posted", "PullJob", "PullReads", "PullState"]  # consumer's import

Notice = tuple[str, P.ReadNotice]  # (producer agent, its notice)


class Posted(NamedTuple):
    """READs a pull posted inline when its request came (`PullReads.post_now`)."""

    posts: list[ReadPost]
    notices: list[Notice]
    results: list[PostResult]
    posted_s: float


class PullReads:
    """Posting, polling, lease heartbeats and release of one daemon's pull READs."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.quarantine = Quarantine(svc)

    def build(self, job: PullJob, engine: Engine, remote: RemoteEngine,
              groups: dict[str, ProducerReads]) -> tuple[list[ReadPost], list[Notice]]:
        """The pull's READs (one per producer daemon with descriptors) and its notices
        (one per producer daemon); sets ``job.nbytes`` and ``job.descriptors``."""
        msg = job.msg
        posts, notices = [], []
        job.nbytes = job.descriptors = 0
        local_pools: tuple[PoolSpan, ...] | None = None
        for g in groups.values():
            notices.append((g.owner, P.ReadNotice(
                request_id=msg.producer_request_id, producer_engine_id=msg.remote_engine_id,
                consumer_engine_id=msg.engine_id, reads=g.reads, nbytes=g.total_nbytes)))
            if not g.descriptors:  # nothing to read from this daemon: notification only
                continue
            # Pools named so that the data path posts through prepared lists (issue
            # 12.1); not for a few descriptors: the lookup then costs more than NIXL's
            # validation.
            prepped = g.descriptors > FRESH_POST_MAX_DESCRIPTORS
            if prepped and local_pools is None:
                local_pools = tuple(PoolSpan(r.pool.addr, r.pool.nbytes, r.device_id)
                                    for r in engine.live_ranks())
            posts.append(ReadPost(peer=g.owner, local_addrs=g.local_addrs,
                                  remote_addrs=g.remote_addrs, nbytes=g.nbytes,
                                  mem_type=remote.desc.mem_type, notif=b"",
                                  local_devs=g.local_devs, remote_devs=g.remote_devs,
                                  local_pools=local_pools if prepped and local_pools else (),
                                  remote_pools=tuple(
                                      PoolSpan(rr.desc.base_addr, rr.desc.nbytes,
                                               rr.desc.device_id)
                                      for rr in remote.ranks.values()
                                      if rr.agent == g.owner) if prepped else ()))
            job.nbytes += g.total_nbytes
            job.descriptors += g.descriptors
        return posts, notices

    @staticmethod
    def posts_early(job: PullJob, posts: list[ReadPost], acquiring: Acquiring) -> bool:
        """Only a small pull posts before the Acquire's reply, unless its publish receipt
        rules out a read-again: the early post saves up to a round trip, which is most
        of a small pull, and a read-again (a young hold) costs a whole READ."""
        return job.nbytes <= EARLY_POST_MAX_BYTES or all(
            acquiring.receipted(p.peer) for p in posts)

    def post_now(self, job: PullJob, engine: Engine, remote: RemoteEngine,
                 groups: dict[str, ProducerReads], acquiring: Acquiring) -> Posted | None:
        """A small pull's READs posted inline, now, before its Acquire's reply (issue
        23.4: in the engine's request itself, no task or loop turn before the READ);
        None, with nothing posted or pinned, when that cannot be done now: the pull's
        task then takes the usual path. Raises nothing a pull would report: the task
        meets the same condition again and reports it."""
        try:
            posts, notices = self.build(job, engine, remote, groups)
            if (not posts or acquiring.answered or not self.posts_early(job, posts, acquiring)
                    or not self.svc.datapath.can_post_now(posts)):
                return None
            self.quarantine.check_room(job.nbytes)
        except KvdError:
            return None
        posted_s = self.svc.clock.now()
        self._pin(job, engine)
        results = self._posted(job, self.svc.datapath.post_reads_now(posts), time.perf_counter())
        if results is None:  # the NIXL lock was taken meanwhile (a thread): not posted
            self.quarantine.unpin(job)
            return None
        return Posted(posts, notices, results, posted_s)

    def finish_now(self, job: PullJob, remote: RemoteEngine, posted: Posted,
                   acquiring: Acquiring) -> bool:
        """Whether the pull ended well now, in this same step: every READ done inline,
        every Acquire answered (replies already queued are taken), none stale, none
        younger than the READ. Then its pools are unpinned and its notices ready, and the
        caller reports it; else nothing is changed and the pull's task goes on from
        ``posted`` (`post_and_wait`), which judges every other outcome as usual."""
        if any(r.error is not None or not r.done for r in posted.results):
            return False
        if acquiring.settle_now() is not True or any(
                acquiring.may_predate_publish(p.peer, posted.posted_s) for p in posted.posts):
            return False
        self._notices(job, remote, posted.notices)
        self.quarantine.unpin(job)
        return True

    async def post_and_wait(self, job: PullJob, engine: Engine, remote: RemoteEngine,
                            groups: dict[str, ProducerReads], acquiring: Acquiring,
                            posted: Posted | None = None) -> bool:
        """Read every group, then notify each producer; False (nothing kept: READs
        released, pools unpinned) when the Acquire found the cached handshake stale.
        ``posted``: the READs `post_now` posted already (the rest goes on from there)."""
        svc = self.svc
        if posted is not None:  # before any reply was seen (post_now)
            posts, notices, results, posted_s = posted
            checked = False
        else:
            posts, notices = self.build(job, engine, remote, groups)
            early = self.posts_early(job, posts, acquiring)
            if (not posts or acquiring.answered or not early) and not await acquiring.settle():
                return False
            results = []
            checked = acquiring.settled  # the replies were judged before posting
            if posts:
                self.quarantine.check_room(job.nbytes)
                posted_s = svc.clock.now()
                results = await self._post(job, engine, posts)
        if posts:
            if not checked:
                if not await acquiring.settle():
                    await self._discard(job)
                    return False
                if any(acquiring.may_predate_publish(p.peer, posted_s) for p in posts):
                    # Common when the Pull follows its Publish within a round trip (a
                    # benchmark); rare in service, where the prefill's answer goes
                    # through the router first.
                    log.debug("READ posted before the request's hold was seen to be older: "
                              "reading again", extra={"request_id": job.msg.request_id})
                    # The first READs must end before new ones go out, and a big READ can
                    # outlast a lease: keep the producers' leases alive meanwhile.
                    job.reading_from = {r.xfer_id: p.peer for p, r in
                                        zip(posts, results, strict=True)
                                        if r.xfer_id is not None}
                    beat = svc.spawn(self._heartbeat(job, remote))
                    try:
                        await self._discard(job)
                    finally:
                        beat.cancel()
                    results = await self._post(job, engine, posts)
            errors = [r.error for r in results if r.error is not None]
            if errors:
                await self._read_failed(job, remote, errors[0])
            pending = [r.xfer_id for r in results if r.xfer_id is not None and not r.done]
            job.reading_from = {r.xfer_id: p.peer for p, r in zip(posts, results, strict=True)
                                if r.xfer_id is not None and not r.done}
            hb = svc.spawn(self._heartbeat(job, remote)) if pending else None
            try:
                await self._wait(job, remote, pending)
            finally:
                if hb is not None:
                    hb.cancel()
        self._notices(job, remote, notices)
        return True

    def _notices(self, job: PullJob, remote: RemoteEngine, notices: list[Notice]) -> None:
        """Every READ is done and every Acquire answered: the producers may count them, as
        soon as the pull is reported (kvd.daemon.consumer sends them)."""
        job.notices = [functools.partial(self._notify, job, remote, agent, notice)
                       for agent, notice in notices]

    def _notify(self, job: PullJob, remote: RemoteEngine, agent: str,
                notice: P.ReadNotice) -> None:
        """Send a producer its ReadNotice as a peer request, not awaited (the pull is done:
        its bytes are read and the hold confirmed). Not a NIXL notification: a standalone
        one holds up the next READ on that connection until the producer progresses
        NIXL. A daemon that refuses the request (an earlier v2) gets the notification; one
        that cannot be reached releases the hold when the lease ends."""
        svc = self.svc
        addrs = [a for a, d in remote.daemons.items() if d.agent == agent]
        if not addrs:
            return

        def sent(fut: asyncio.Future[Reply]) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if isinstance(exc, ProtocolError):  # "unknown message kind": an earlier v2
                svc.spawn(self._notify_by_nixl(job, agent, notice))
            elif exc is not None:
                svc.metrics.notifications_failed.inc()
                log.info("READ notice to %s not delivered (%s); the lease will release the "
                         "request", addrs[0], exc,
                         extra={"request_id": job.msg.request_id, "peer": addrs[0]})

        svc.peers.send(addrs[0], notice).add_done_callback(sent)

    async def _notify_by_nixl(self, job: PullJob, agent: str, notice: P.ReadNotice) -> None:
        try:
            await self.svc.datapath.send_notif(agent, P.encode_notice(notice))
        except TransferError as exc:
            self.svc.metrics.notifications_failed.inc()
            log.info("READ notice to %s not delivered (%s); the lease will release the "
                     "request", agent, exc, extra={"request_id": job.msg.request_id})

    @staticmethod
    def _pin(job: PullJob, engine: Engine) -> None:
        for r in engine.live_ranks():
            r.pins += 1
            job.pinned.append(r)

    def _posted(self, job: PullJob, results: list[PostResult] | None, t0: float
                ) -> list[PostResult] | None:
        """Note the handles of posted READs (None: nothing was posted) and count them."""
        if results is None:
            return None
        job.xfers = [r.xfer_id for r in results if r.xfer_id is not None]
        job.live = set(job.xfers)
        # counted in the metrics once the engine has its answer (Consumer._report)
        job.posted.append((time.perf_counter() - t0, job.descriptors,
                           [r.timing for r in results]))
        return results

    async def _post(self, job: PullJob, engine: Engine, posts: list[ReadPost]
                    ) -> list[PostResult]:
        """Pin the local pools and post, recording the handles even when cancelled
        meanwhile: the READs exist on the NIXL thread either way, and must be released
        before the pools are unpinned."""
        svc = self.svc
        self._pin(job, engine)
        t0 = time.perf_counter()
        results = svc.datapath.post_reads_now(posts)  # a small post: no task, no loop turn
        if results is None:
            post = asyncio.ensure_future(svc.datapath.post_reads(posts))
            try:
                results = await asyncio.shield(post)
            except asyncio.CancelledError:
                self._posted(job, await post, t0)
                raise
        posted = self._posted(job, results, t0)
        assert posted is not None
        return posted

    async def _discard(self, job: PullJob) -> None:
        """READs whose bytes are not trusted: let them end (failed or not; a new READ
        must not race them into the same blocks), release them, unpin."""
        pending, interval_s = list(job.xfers), FIRST_POLL_S
        while pending:
            states = await self.svc.datapath.poll_many(pending)
            pending = [x for x, s in states.items() if s.state is XferState.PENDING]
            job.live.intersection_update(pending)
            if pending:
                await self.svc.clock.sleep(interval_s)
                interval_s = min(interval_s * 2, MAX_POLL_S)
        await self.release(job)

    async def _wait(self, job: PullJob, remote: RemoteEngine, pending: list[int]) -> None:
        interval_s, spins = FIRST_POLL_S, 0
        while pending:
            if spins < SPIN_POLLS:  # a small READ ends within a few loop turns
                spins += 1
                await self.svc.clock.sleep(0)
            else:
                await self.svc.clock.sleep(interval_s)
                interval_s = min(interval_s * 2, MAX_POLL_S)
            states = await self.svc.datapath.poll_many(pending)
            job.live.difference_update(x for x, s in states.items()
                                       if s.state is not XferState.PENDING)
            failed = [s.error for s in states.values() if s.error is not None]
            if failed:
                await self._read_failed(job, remote, failed[0])
            pending = [x for x, s in states.items() if s.state is XferState.PENDING]
            job.reading_from = {x: job.reading_from[x] for x in pending}
            now = self.svc.clock.now()
            for agent, (since_s, exc) in job.lost.items():
                if agent in job.reading_from.values() and now - since_s >= LOST_GRACE_S:
                    raise exc
            self._check_alive(remote, job)

    def _check_alive(self, remote: RemoteEngine, job: PullJob) -> None:
        """A producer whose control connection liveness dropped (ZMTP heartbeats silent
        for peer_liveness_timeout_s: dead, partitioned or frozen; or its TCP connection
        closed) fails the pull now, without waiting for the transport to notice: the
        failing pull's READs are then severed (kvd.daemon.quarantine) and it is
        reported within one poll."""
        reading = set(job.reading_from.values())
        conns = self.svc.peers.conns
        for addr, known in remote.daemons.items():
            conn = conns.get(addr)
            if known.agent in reading and conn is not None and conn.connected is False:
                raise PeerLostError(f"producer daemon {addr} is unreachable: its control "
                                    "connection was lost mid-READ (peer_liveness_timeout_s)")

    async def _read_failed(self, job: PullJob, remote: RemoteEngine, exc: TransferError) -> None:
        """Drop the cached producer daemons and raise: peer_lost if a producer daemon is
        gone or another incarnation now, else the transfer error itself."""
        peers = self.svc.peers
        for addr in remote.daemons:
            peers.drop_address(addr, "READ failed")
        for addr, known in remote.daemons.items():
            conn = peers.conns.get(addr)
            if conn is not None and conn.connected is False:  # ZMTP heartbeats lost it
                raise PeerLostError(f"producer daemon {addr} is unreachable after a failed "
                                    f"READ ({exc})")
            try:
                reply = await peers.request(addr, P.Heartbeat(
                    producer_engine_id=job.msg.remote_engine_id, request_ids=[]),
                    min(PROBE_TIMEOUT_S, self.svc.cfg.handshake_timeout_s))
            except KvdError:
                raise PeerLostError(f"producer daemon {addr} is unreachable after a failed "
                                    f"READ ({exc})") from None
            if reply.instance != known.instance:
                raise PeerLostError(f"producer daemon {addr} restarted during the pull ({exc})")
        raise exc

    async def _heartbeat(self, job: PullJob, remote: RemoteEngine) -> None:
        """Keep the producers' leases alive while our READs run; notice a lost request."""
        msg = job.msg
        beat = P.Heartbeat(producer_engine_id=msg.remote_engine_id,
                           request_ids=[msg.producer_request_id])
        while True:
            await self.svc.clock.sleep(self.svc.cfg.heartbeat_interval_s)
            for addr, known in remote.daemons.items():
                if known.agent not in job.reading_from.values() or known.agent in job.lost:
                    continue  # its READ is done: nothing to keep alive there
                try:
                    reply = await self.svc.peers.request(addr, beat)
                except KvdError as exc:
                    log.warning("lease heartbeat to %s failed: %s", addr, exc,
                                extra={"request_id": msg.request_id, "peer": addr})
                    continue
                now = self.svc.clock.now()
                if reply.instance != known.instance:
                    job.lost[known.agent] = (now, PeerLostError(
                        f"producer daemon {addr} restarted during the pull"))
                elif reply.body.unknown:
                    job.lost[known.agent] = (now, PeerLostError(
                        f"producer daemon {addr} no longer holds request "
                        f"{msg.producer_request_id!r} (lease expired?)"))

    async def release(self, job: PullJob) -> None:
        """Release the pull's READs and unpin its pools, once none can land any more
        (kvd.daemon.quarantine)."""
        await self.quarantine.release(job)

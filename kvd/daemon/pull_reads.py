"""The READ phase of a pull, and the pull's record (`PullJob`).

`PullReads` posts one READ per producer daemon (through prepared lists where the
pools are named), polls them until done, keeps the producers' leases alive
meanwhile (heartbeats), and tells a lost or restarted producer (``peer_lost``)
from a failed READ. The local pools stay pinned from posting until `release` has
released every transfer handle. kvd.daemon.consumer drives the pull around it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

from kvd import protocol as P
from kvd.daemon.datapath import PostResult, XferState
from kvd.daemon.engines import Engine, EngineRank
from kvd.daemon.peers import RemoteEngine
from kvd.daemon.services import Services
from kvd.errors import KvdError, PeerLostError, TransferError
from kvd.planner.assembly import ProducerReads
from kvd.transport.base import PoolSpan, ReadPost

log = logging.getLogger("kvd.consumer")

# READ completion polling: from FIRST_POLL_S, doubling to MAX_POLL_S (a 1-block pull
# completes in well under a millisecond; a multi-GiB one takes seconds).
FIRST_POLL_S = 0.0001
MAX_POLL_S = 0.002
PROBE_TIMEOUT_S = 1.0  # after a failed READ: is the producer daemon still the same one?
# A producer that no longer holds our request (or restarted) fails the pull only if the
# READ from it is still pending this long after: a producer releases the hold when our
# READ's notice arrives, which may be a moment before we see the READ done ourselves.
LOST_GRACE_S = 0.05


class PullState(enum.Enum):
    QUEUED = "queued"
    WAITING_RANKS = "waiting_ranks"
    HANDSHAKING = "handshaking"
    ACQUIRING = "acquiring"
    READING = "reading"
    DONE = "done"
    FAILED = "failed"


@dataclass
class PullJob:
    msg: P.Pull
    started_s: float
    state: PullState = PullState.QUEUED
    nbytes: int = 0
    descriptors: int = 0
    xfers: list[int] = field(default_factory=list)
    pinned: list[EngineRank] = field(default_factory=list)
    acquired: list[str] = field(default_factory=list)  # producer daemons holding it for us
    remote: RemoteEngine | None = None
    reading_from: dict[int, str] = field(default_factory=dict)  # pending xfer -> agent
    lost: dict[str, tuple[float, PeerLostError]] = field(default_factory=dict)  # by agent
    cancel_reason: KvdError | None = None  # why the daemon cancelled the task
    task: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.msg.engine_id, self.msg.request_id)


class PullReads:
    """Posting, polling, lease heartbeats and release of one daemon's pull READs."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    async def post_and_wait(self, job: PullJob, engine: Engine, remote: RemoteEngine,
                             groups: dict[str, ProducerReads]) -> None:
        msg, svc = job.msg, self.svc
        posts, notify_only = [], []
        # Pools named so that the data path posts through prepared lists (issue 12.1).
        local_pools = tuple(PoolSpan(r.pool.addr, r.pool.nbytes, r.device_id)
                            for r in engine.live_ranks())
        for g in groups.values():
            notice = P.encode_notice(P.ReadNotice(
                request_id=msg.producer_request_id, producer_engine_id=msg.remote_engine_id,
                consumer_engine_id=msg.engine_id, reads=g.reads, nbytes=g.total_nbytes))
            if not g.descriptors:  # nothing to read from this daemon: notification only
                notify_only.append((g.owner, notice))
                continue
            posts.append(ReadPost(peer=g.owner, local_addrs=g.local_addrs,
                                  remote_addrs=g.remote_addrs, nbytes=g.nbytes,
                                  mem_type=remote.desc.mem_type, notif=notice,
                                  local_devs=g.local_devs, remote_devs=g.remote_devs,
                                  local_pools=local_pools,
                                  remote_pools=tuple(
                                      PoolSpan(rr.desc.base_addr, rr.desc.nbytes,
                                               rr.desc.device_id)
                                      for rr in remote.ranks.values() if rr.agent == g.owner)))
            job.nbytes += g.total_nbytes
            job.descriptors += g.descriptors
        if posts:
            for r in engine.live_ranks():
                r.pins += 1
                job.pinned.append(r)
            t0 = time.perf_counter()
            results = await self._post(job, posts)
            svc.metrics.post_duration.observe(time.perf_counter() - t0)
            svc.metrics.descriptors_posted.inc(job.descriptors)
            svc.metrics.reads_posted([r.timing for r in results])
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
        for agent, notice in notify_only:
            try:
                await svc.datapath.send_notif(agent, notice)
            except TransferError as exc:
                svc.metrics.notifications_failed.inc()
                await self._read_failed(job, remote, exc)

    async def _post(self, job: PullJob, posts: list[ReadPost]) -> list[PostResult]:
        """Post, and record the handles even when cancelled meanwhile: the READs exist on
        the NIXL thread either way, and must be released before the pools are unpinned."""
        post = asyncio.ensure_future(self.svc.datapath.post_reads(posts))
        try:
            results = await asyncio.shield(post)
        except asyncio.CancelledError:
            results = await post
            job.xfers = [r.xfer_id for r in results if r.xfer_id is not None]
            raise
        job.xfers = [r.xfer_id for r in results if r.xfer_id is not None]
        return results

    async def _wait(self, job: PullJob, remote: RemoteEngine, pending: list[int]) -> None:
        interval_s = FIRST_POLL_S
        while pending:
            await self.svc.clock.sleep(interval_s)
            states = await self.svc.datapath.poll_many(pending)
            failed = [s.error for s in states.values() if s.error is not None]
            if failed:
                await self._read_failed(job, remote, failed[0])
            pending = [x for x, s in states.items() if s.state is XferState.PENDING]
            job.reading_from = {x: job.reading_from[x] for x in pending}
            now = self.svc.clock.now()
            for agent, (since_s, exc) in job.lost.items():
                if agent in job.reading_from.values() and now - since_s >= LOST_GRACE_S:
                    raise exc
            interval_s = min(interval_s * 2, MAX_POLL_S)

    async def _read_failed(self, job: PullJob, remote: RemoteEngine, exc: TransferError) -> None:
        """Drop the cached producer daemons and raise: peer_lost if a producer daemon is
        gone or another incarnation now, else the transfer error itself."""
        peers = self.svc.peers
        for addr in remote.daemons:
            peers.drop_address(addr, "READ failed")
        for addr, known in remote.daemons.items():
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
        """Release (abort) every transfer handle, then unpin the local pools."""
        if job.xfers:
            xfers, job.xfers = job.xfers, []
            await asyncio.shield(self.svc.datapath.release(xfers))
        for r in job.pinned:
            r.pins -= 1
        job.pinned = []

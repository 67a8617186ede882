"""Consumer side: one pull = handshake (cached) -> plan -> descriptors -> READs -> event.

    QUEUED -> HANDSHAKING -> ACQUIRING -> READING -> DONE
                   \\______________\\___________\\--> FAILED

A pull is named once per decode engine; kvd reads for every rank of that
engine it hosts. Local pools are pinned from posting until every transfer
handle is released, so a pool is never freed while a READ may write into it;
a pull only reports FAILED after its transfers are released (aborted).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvd import protocol as P
from kvd.daemon.engines import compat_hash, geometry, parallelism, rank_layout
from kvd.errors import BusyError, IncompatibleError, KvdError, KvdTimeoutError, TransferError
from kvd.planner import TransferPlan, build_read_descriptors, plan_transfer
from kvd.planner.blocks import match_blocks
from kvd.transport.base import ReadPost

if TYPE_CHECKING:
    from kvd.daemon.engines import Engine, EngineRank
    from kvd.daemon.peers import RemoteEngine
    from kvd.daemon.server import Daemon

log = logging.getLogger("kvd.consumer")


class PullState(enum.Enum):
    QUEUED = "queued"
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

    @property
    def key(self) -> tuple[str, str]:
        return (self.msg.engine_id, self.msg.request_id)


@dataclass
class PostGroup:
    """Everything one pull reads from one producer daemon (one NIXL READ)."""

    agent: str
    daemon: str
    reads: int = 0
    total_nbytes: int = 0
    local: list[np.ndarray] = field(default_factory=list)
    remote: list[np.ndarray] = field(default_factory=list)
    nbytes: list[np.ndarray] = field(default_factory=list)
    # GPU index of each descriptor's memory on each side (0 for DRAM)
    local_dev: list[np.ndarray] = field(default_factory=list)
    remote_dev: list[np.ndarray] = field(default_factory=list)


class Consumer:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.jobs: dict[tuple[str, str], PullJob] = {}
        self.plans: dict[tuple, TransferPlan] = {}

    def start(self, msg: P.Pull) -> None:
        """Validate cheaply and queue; the outcome arrives later as a done_recving event."""
        cfg = self.d.cfg
        engine = self.d.engines.get(msg.engine_id)
        if (msg.engine_id, msg.request_id) in self.jobs:
            raise KvdError(f"request {msg.request_id!r} is already being pulled")
        if len(self.jobs) >= cfg.max_inflight_pulls:
            raise BusyError(f"{len(self.jobs)} pulls in flight (max_inflight_pulls)")
        for name, ids in (("local", msg.local_block_ids), ("remote", msg.remote_block_ids)):
            if len(ids) > cfg.max_blocks_per_request:
                raise KvdError(f"{len(ids)} {name} blocks exceed max_blocks_per_request")
        num_blocks = engine.layout.num_blocks
        bad = [b for b in msg.local_block_ids if not 0 <= b < num_blocks]
        if bad:
            raise KvdError(f"local block ids {bad[:8]} out of range [0, {num_blocks})")
        job = PullJob(msg=msg, started_s=self.d.clock())
        self.jobs[job.key] = job
        self.d.metrics.inflight_transfers.inc()
        self.d.spawn(self._run(job, engine))

    async def _run(self, job: PullJob, engine: Engine) -> None:
        msg = job.msg
        try:
            await asyncio.wait_for(self._pull(job, engine), self.d.cfg.transfer_timeout_s)
            outcome, error = "ok", ""
        except KvdError as exc:
            # Before TimeoutError: KvdTimeoutError (a handshake or acquire that timed out) is
            # one too, and must keep its own message rather than read as the whole pull's.
            outcome, error = "failed", f"{exc.code}: {exc}"
        except asyncio.TimeoutError:
            outcome, error = "failed", f"pull timed out after {self.d.cfg.transfer_timeout_s}s"
        except asyncio.CancelledError:
            outcome, error = "cancelled", "pull cancelled (engine gone or daemon stopping)"
        except Exception as exc:  # noqa: BLE001 - never let one pull take the daemon down
            log.exception("pull %s crashed", msg.request_id)
            outcome, error = "failed", f"internal error: {exc!r}"
        finally:
            await self._release(job)
        ok = outcome == "ok"
        if not ok and job.acquired:
            # Our READs are released: tell the producers not to hold the blocks for us
            # until the lease ends (best effort; the lease still bounds the hold).
            self.d.spawn(self._abandon(msg, job.acquired))
        job.state = PullState.DONE if ok else PullState.FAILED
        self.jobs.pop(job.key, None)
        m = self.d.metrics
        m.inflight_transfers.dec()
        duration_s = self.d.clock() - job.started_s
        m.transfer_finished("consumer", outcome, job.nbytes, duration_s)
        invalid = [] if ok else list(msg.local_block_ids)
        if invalid:
            m.invalid_blocks.inc(len(invalid))
            log.warning("pull failed: %s", error,
                        extra={"request_id": msg.request_id, "engine_id": msg.engine_id,
                               "peer": msg.remote_address})
        self.d.events.push(msg.engine_id, P.Event(
            kind="done_recving", request_id=msg.request_id, ok=ok, invalid_block_ids=invalid,
            error=error, nbytes=job.nbytes if ok else 0, duration_s=duration_s))

    async def _pull(self, job: PullJob, engine: Engine) -> None:
        msg = job.msg
        job.state = PullState.HANDSHAKING
        remote = await self.d.handshake(engine, msg.remote_engine_id, msg.remote_address)
        job.state = PullState.ACQUIRING
        if not await self._acquire(job, remote):
            # The producer's pools changed since we cached the handshake: redo it once.
            self.d.peers.forget(msg.engine_id, msg.remote_engine_id)
            job.state = PullState.HANDSHAKING
            remote = await self.d.handshake(engine, msg.remote_engine_id, msg.remote_address)
            job.state = PullState.ACQUIRING
            if not await self._acquire(job, remote):
                raise KvdError(f"engine {msg.remote_engine_id!r} keeps changing its pools")
        if compat_hash(remote.desc.model, remote.desc.layout) != engine.compat:
            raise IncompatibleError(
                f"engine {msg.remote_engine_id!r} is incompatible with {msg.engine_id!r} "
                f"(model/dtype/layout differ: {remote.desc.model} {remote.desc.layout})")
        plan = self._plan(engine, remote)
        local_ids, remote_ids = match_blocks(msg.local_block_ids, msg.remote_block_ids,
                                             engine.layout.block_size_tokens,
                                             remote.desc.layout.block_size_tokens)
        if not engine.live_ranks():
            raise KvdError(f"engine {msg.engine_id!r} left before its READs were posted")
        groups = self._descriptors(job, engine, remote, plan, local_ids, remote_ids)
        job.state = PullState.READING
        await self._post_and_wait(job, engine, remote, groups)

    def _plan(self, engine: Engine, remote: RemoteEngine) -> TransferPlan:
        rpar = parallelism(remote.desc.tp_size, remote.desc.pp_size, remote.desc.layer_partition)
        key = (geometry(engine.model), rpar, engine.par)
        plan = self.plans.get(key)
        if plan is None:
            self.d.metrics.plan_cache_misses.inc()
            plan = self.plans[key] = plan_transfer(geometry(engine.model), rpar, engine.par)
        else:
            self.d.metrics.plan_cache_hits.inc()
        return plan

    def _descriptors(self, job: PullJob, engine: Engine, remote: RemoteEngine,
                     plan: TransferPlan, local_ids: np.ndarray,
                     remote_ids: np.ndarray) -> dict[str, PostGroup]:
        groups: dict[str, PostGroup] = {
            agent: PostGroup(agent=agent, daemon=addr) for addr, agent in remote.daemons.items()
        }
        rpar = parallelism(remote.desc.tp_size, remote.desc.pp_size, remote.desc.layer_partition)
        for local_rank in engine.live_ranks():
            for read in plan.reads_for(local_rank.rank):
                rr = remote.ranks[read.remote]
                if local_ids.size == 0:
                    # Notify only (vLLM: zero local blocks): no bytes move, but the producer
                    # must still count this consumer's reads as done to release the request.
                    groups[rr.agent].reads += 1
                    continue
                rcache, rfirst = rank_layout(remote.desc.model, remote.desc.layout, rpar,
                                             read.remote.pp_rank, rr.desc.num_blocks)
                descs = build_read_descriptors(read, local_rank.cache, local_rank.first_layer,
                                               rcache, rfirst, local_ids, remote_ids)
                g = groups[rr.agent]
                g.reads += 1
                g.total_nbytes += descs.total_nbytes
                g.local.append(descs.local_offsets + local_rank.pool.addr)
                g.remote.append(descs.remote_offsets + rr.desc.base_addr)
                g.nbytes.append(descs.nbytes)
                g.local_dev.append(np.full(len(descs), local_rank.device_id, dtype=np.int64))
                g.remote_dev.append(np.full(len(descs), rr.desc.device_id, dtype=np.int64))
                job.nbytes += descs.total_nbytes
                job.descriptors += len(descs)
        return groups

    async def _acquire(self, job: PullJob, remote: RemoteEngine) -> bool:
        """Every producer daemon must still hold the request before any byte moves.

        Returns False when a daemon's pool epoch differs from the cached handshake.
        """
        msg = job.msg
        acquire = P.Acquire(request_id=msg.producer_request_id,
                            producer_engine_id=msg.remote_engine_id,
                            consumer_engine_id=msg.engine_id,
                            block_ids=list(msg.remote_block_ids))
        addrs = list(remote.daemons)
        replies = await asyncio.gather(*(
            self.d.peers.conn(addr).request(acquire, self.d.cfg.handshake_timeout_s)
            for addr in addrs
        ), return_exceptions=True)
        job.acquired = [a for a, r in zip(addrs, replies, strict=True)
                        if isinstance(r, P.Acquired)]
        for r in replies:
            if isinstance(r, BaseException):
                raise r
        return all(r.epoch == remote.epochs.get(addr)
                   for addr, r in zip(remote.daemons, replies, strict=True))

    async def _post_and_wait(self, job: PullJob, engine: Engine, remote: RemoteEngine,
                             groups: dict[str, PostGroup]) -> None:
        msg = job.msg
        posts, notify_only = [], []
        for g in groups.values():
            notice = P.encode_notice(P.ReadNotice(
                request_id=msg.producer_request_id, producer_engine_id=msg.remote_engine_id,
                consumer_engine_id=msg.engine_id, reads=g.reads, nbytes=g.total_nbytes))
            if not g.local:  # nothing to read from this daemon: notification only
                notify_only.append((g.agent, notice))
                continue
            posts.append(ReadPost(
                peer=g.agent, local_addrs=np.concatenate(g.local),
                remote_addrs=np.concatenate(g.remote), nbytes=np.concatenate(g.nbytes),
                mem_type=remote.desc.mem_type, notif=notice,
                local_devs=np.concatenate(g.local_dev),
                remote_devs=np.concatenate(g.remote_dev)))
        if posts:
            for r in engine.live_ranks():
                r.pins += 1
                job.pinned.append(r)
            t0 = time.perf_counter()
            results = await self.d.datapath.post_reads(posts)
            self.d.metrics.post_duration.observe(time.perf_counter() - t0)
            self.d.metrics.descriptors_posted.inc(job.descriptors)
            job.xfers = [x for x, _, _ in results if x is not None]
            errors = [e for _, _, e in results if e is not None]
            if errors:
                raise TransferError("; ".join(errors))
            pending = [x for x, done, _ in results if x is not None and not done]
            hb = self.d.spawn(self._heartbeat(msg, remote)) if pending else None
            try:
                await self._wait(pending)
            finally:
                if hb is not None:
                    hb.cancel()
        for agent, notice in notify_only:
            err = await self.d.datapath.send_notif(agent, notice)
            if err:
                self.d.metrics.notifications_failed.inc()
                raise TransferError(f"notify-only to {agent} failed: {err}")

    async def _wait(self, pending: list[int]) -> None:
        interval_s = 0.0001
        while pending:
            await asyncio.sleep(interval_s)
            states = await self.d.datapath.poll_many(pending)
            failed = [s for s in states.values() if s not in ("done", "proc")]
            if failed:
                raise TransferError(failed[0])
            pending = [x for x, s in states.items() if s == "proc"]
            interval_s = min(interval_s * 2, 0.002)

    async def _abandon(self, msg: P.Pull, addrs: list[str]) -> None:
        note = P.Abandon(request_id=msg.producer_request_id,
                         producer_engine_id=msg.remote_engine_id,
                         consumer_engine_id=msg.engine_id)
        for addr in addrs:
            try:
                await self.d.peers.conn(addr).request(note, self.d.cfg.handshake_timeout_s)
            except KvdError as exc:
                log.info("abandon to %s not delivered (%s); the lease will release it", addr,
                         exc, extra={"request_id": msg.request_id, "peer": addr})

    async def _heartbeat(self, msg: P.Pull, remote: RemoteEngine) -> None:
        """Keep the producer's lease alive while our READs run."""
        beat = P.Heartbeat(producer_engine_id=msg.remote_engine_id,
                           request_ids=[msg.producer_request_id])
        while True:
            await asyncio.sleep(self.d.cfg.heartbeat_interval_s)
            for addr in remote.daemons:
                try:
                    await self.d.peers.conn(addr).request(beat, self.d.cfg.handshake_timeout_s)
                except (KvdError, KvdTimeoutError) as exc:
                    log.warning("lease heartbeat to %s failed: %s", addr, exc,
                                extra={"request_id": msg.request_id, "peer": addr})

    async def _release(self, job: PullJob) -> None:
        """Release (abort) every transfer handle, then unpin the local pools."""
        if job.xfers:
            await self.d.datapath.release(job.xfers)
            job.xfers = []
        for r in job.pinned:
            r.pins -= 1
        job.pinned = []

    def status(self) -> list[dict]:
        now = self.d.clock()
        return [{"engine_id": j.msg.engine_id, "request_id": j.msg.request_id,
                 "state": j.state.value, "age_s": round(now - j.started_s, 3),
                 "remote_engine_id": j.msg.remote_engine_id, "nbytes": j.nbytes}
                for j in self.jobs.values()]


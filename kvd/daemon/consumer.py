"""Consumer side: one task per pull, from the request to its done_recving event.

    QUEUED -> WAITING_RANKS -> HANDSHAKING -> ACQUIRING -> READING -> DONE | FAILED

A pull waits (bounded) for every rank of its engine, handshakes (cached),
acquires the request from every producer daemon, assembles the descriptors
(kvd.planner.assembly), posts one READ per producer daemon and waits for them,
renewing the producers' leases meanwhile (that READ phase: kvd.daemon.pull_reads,
with the pull's record `PullJob`). Its local pools are pinned from posting
until every transfer handle is released, and only then is the outcome reported:
a failed pull reports every local block invalid, never ok with wrong bytes.

A producer found restarted or gone while the pull depends on it fails the pull
with ``peer_lost``; the cached handshake is dropped so the next pull greets the
new incarnation.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from kvd.daemon import hybrid
from kvd.daemon.engines import (
    Engine,
    PlanCache,
    check_block_ids,
    geometry,
    parallelism,
    rank_layout,
)
from kvd.daemon.peers import RemoteEngine
from kvd.daemon.pull_reads import Acquiring, Posted, PullJob, PullReads, PullState
from kvd.daemon.services import Services
from kvd.errors import (
    BlockIdError,
    BusyError,
    DrainingError,
    IncompatibleError,
    KvdError,
    TooLargeError,
)
from kvd.planner import Parallelism, RankId
from kvd.planner.assembly import (
    PreparedPull,
    ProducerReads,
    RankPool,
    match_tail,
    prepare_pull,
)
from kvd.wire import protocol as P

log = logging.getLogger("kvd.consumer")

MAX_PREPARED = 256  # (engine, peer engine) pairs kept ready; cleared past it


class Head(NamedTuple):
    """Where `Consumer._pull_now` left a pull for its task: the READs it posted."""

    engine: Engine
    groups: dict[str, ProducerReads]
    posted: Posted


class Consumer:
    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self.jobs: dict[tuple[str, str], PullJob] = {}
        self.plans = PlanCache()
        # (engine, peer engine) -> (prepared assembly, the handshake, the engine and its
        # epoch: both change with every rank that registers or leaves)
        self._ready: dict[tuple[str, str], tuple[PreparedPull, RemoteEngine, Engine, int]] = {}
        self.reads = PullReads(svc)

    def start(self, msg: P.Pull, reply_to: tuple[bytes, int] | None = None) -> None:
        """Validate cheaply and queue; the outcome arrives later as a done_recving event,
        queued for the engine's polls or, with ``reply_to`` (identity, request id), sent
        as the answer to that one request."""
        cfg = self.svc.cfg
        engine = self.svc.registry.get(msg.engine_id)
        if (msg.engine_id, msg.request_id) in self.jobs:
            raise KvdError(f"request {msg.request_id!r} is already being pulled")
        if len(self.jobs) >= cfg.max_inflight_pulls:
            raise BusyError(f"{len(self.jobs)} pulls in flight (max_inflight_pulls)")
        for name, ids in (("local", msg.local_block_ids), ("remote", msg.remote_block_ids)):
            if len(ids) > cfg.max_blocks_per_request:
                raise TooLargeError(f"{len(ids)} {name} blocks exceed max_blocks_per_request "
                                    f"({cfg.max_blocks_per_request})")
        check_block_ids(msg.local_block_ids, engine.layout.num_blocks, "local")
        negative = [b for b in msg.remote_block_ids if b < 0]
        if negative:
            raise BlockIdError(f"remote block ids {negative[:8]} are negative")
        hybrid.check_pull(engine.model, msg)
        job = PullJob(msg=msg, started_s=self.svc.clock.now(), reply_to=reply_to)
        self.jobs[job.key] = job
        self.svc.metrics.inflight_transfers.inc()
        job.early = self._early_acquire(job, engine)
        head = self._pull_now(job, engine) if job.early is not None else None
        if job.key in self.jobs:  # not reported already
            job.task = self.svc.spawn(self._run(job, head))

    def _pull_now(self, job: PullJob, engine: Engine) -> Head | None:
        """A small pull with its handshake cached, in the engine's request itself (issue
        23.4): its READ is posted inline before any task or loop turn, and when that READ
        is done and its Acquire's replies are already here, it is reported now, in this
        same step. Otherwise the pull's task goes on from where this stopped (the READs
        it posted: returned), or starts afresh (None: nothing was posted)."""
        acquiring = job.early
        assert acquiring is not None
        remote = acquiring.remote
        try:
            groups = self._groups(job, engine, remote)
        except Exception:  # noqa: BLE001 - the task meets it again, and reports it
            return None
        posted = self.reads.post_now(job, engine, remote, groups, acquiring)
        if posted is None:
            return None
        job.remote, job.state = remote, PullState.READING
        if self.reads.finish_now(job, remote, posted, acquiring):
            job.early = None
            self._report(job, "ok", "")
            return None
        return Head(engine, groups, posted)

    def _early_acquire(self, job: PullJob, engine: Engine) -> Acquiring | None:
        """With the handshake cached and the engine complete, the Acquire leaves now,
        before the pull's task even starts: its round trip overlaps the rest."""
        msg, svc = job.msg, self.svc
        remote = svc.peers.cached(msg.engine_id, msg.remote_engine_id, msg.remote_address)
        if remote is None or engine.missing_ranks(svc.cfg.peer_advertise):
            return None
        try:
            return Acquiring.send(svc, job, engine, remote)
        except Exception:  # noqa: BLE001 - the task sends it again, and reports its failure
            log.debug("early Acquire not sent", exc_info=True)
            return None

    def cancel_all(self, reason: KvdError) -> list[asyncio.Task[None]]:
        """Fail every pull now (drain timeout): each releases its READs, then reports."""
        tasks = []
        for job in list(self.jobs.values()):
            if job.task is not None and not job.task.done():
                job.cancel_reason = reason
                job.task.cancel()
                tasks.append(job.task)
        return tasks

    async def _run(self, job: PullJob, head: Head | None = None) -> None:
        msg, cfg, clock = job.msg, self.svc.cfg, self.svc.clock
        # The pull's deadline cancels this very task (clock.wait_for would run the pull in
        # a task of its own: two more loop turns per pull).
        task = asyncio.current_task()
        assert task is not None
        timer = clock.call_later(max(0.0, cfg.transfer_timeout_s - (clock.now() - job.started_s)),
                                 lambda: self._time_out(job, task))
        try:
            await self._pull(job, head)
            outcome, error = "ok", ""
        except KvdError as exc:
            # Before TimeoutError: KvdTimeoutError (a handshake or acquire that timed out) is
            # one too, and must keep its own message rather than read as the whole pull's.
            outcome, error = "failed", f"{exc.code}: {exc}"
        except TimeoutError:
            outcome, error = "failed", f"timeout: pull timed out after {cfg.transfer_timeout_s}s"
        except asyncio.CancelledError:
            if job.timed_out and job.cancel_reason is None:
                task.uncancel()
                outcome = "failed"
                error = f"timeout: pull timed out after {cfg.transfer_timeout_s}s"
            else:
                reason = job.cancel_reason or DrainingError("pull cancelled (engine gone or "
                                                            "daemon stopping)")
                outcome, error = "cancelled", f"{reason.code}: {reason}"
        except Exception as exc:  # noqa: BLE001 - never let one pull take the daemon down
            log.exception("pull %s crashed", msg.request_id)
            outcome, error = "failed", f"internal: {exc!r}"
        finally:
            timer.cancel()
            await self.reads.release(job)
        self._report(job, outcome, error)

    @staticmethod
    def _time_out(job: PullJob, task: asyncio.Task[None]) -> None:
        if not task.done():
            job.timed_out = True
            task.cancel()

    def _report(self, job: PullJob, outcome: str, error: str) -> None:
        msg, svc = job.msg, self.svc
        ok = outcome == "ok"
        if not ok and job.acquired:
            # Our READs are released: tell the producers not to hold the blocks for us
            # until the lease ends (best effort; the lease still bounds the hold).
            svc.spawn(self._abandon(msg, job.acquired))
        job.state = PullState.DONE if ok else PullState.FAILED
        self.jobs.pop(job.key, None)
        duration_s = svc.clock.now() - job.started_s
        invalid = [] if ok else list(msg.local_block_ids)
        event = P.Event(
            kind="done_recving", request_id=msg.request_id, ok=ok, invalid_block_ids=invalid,
            error=error, nbytes=job.nbytes if ok else 0, duration_s=duration_s,
            invalid_group_block_ids=[] if ok else list(msg.local_group_block_ids or []),
            descriptors=job.descriptors)
        self._deliver(job, event)
        # Metrics and the log after the engine's answer (issue 23.4: off its path); in the
        # same loop turn, so no later request sees them stale.
        m = svc.metrics
        for post_s, descriptors, timings in job.posted:
            m.post_duration.observe(post_s)
            m.descriptors_posted.inc(descriptors)
            m.reads_posted(timings)
        m.inflight_transfers.dec()
        m.transfer_finished("consumer", outcome, job.nbytes, duration_s)
        if invalid:
            m.invalid_blocks.inc(len(invalid))
            log.warning("pull failed: %s", error,
                        extra={"request_id": msg.request_id, "engine_id": msg.engine_id,
                               "peer": msg.remote_address})
        # The producers count our reads only now, after the engine heard (a notice is not
        # on the pull's path): every READ is done and every Acquire answered.
        notices, job.notices = job.notices, []
        for send in notices if ok else ():
            send()

    def _deliver(self, job: PullJob, event: P.Event) -> None:
        if job.reply_to is not None:
            self.svc.events.answer(*job.reply_to, event)
        else:
            self.svc.events.push(job.msg.engine_id, event)

    async def _pull(self, job: PullJob, head: Head | None = None) -> None:
        msg, svc = job.msg, self.svc
        tries = 2
        if head is not None:  # READs posted by _pull_now: go on from there
            acquiring, job.early = job.early, None
            assert acquiring is not None and job.remote is acquiring.remote
            if await self.reads.post_and_wait(job, head.engine, acquiring.remote, head.groups,
                                              acquiring, head.posted):
                return
            svc.peers.forget(msg.engine_id, msg.remote_engine_id)
            tries = 1
        job.state = PullState.WAITING_RANKS
        engine = await svc.registry.complete(msg.engine_id, svc.cfg.handshake_timeout_s)
        for _ in range(tries):
            job.state = PullState.HANDSHAKING
            remote = job.remote = await svc.peers.remote_engine(engine, msg.remote_engine_id,
                                                                msg.remote_address)
            job.state = PullState.ACQUIRING
            # On the wire now (or since the Pull came); its replies are awaited only when
            # the READs need them.
            early, job.early = job.early, None
            if early is not None and early.remote is remote:
                acquiring = early
            else:
                if early is not None:  # the cached handshake changed meanwhile
                    svc.spawn(early.forget())
                acquiring = Acquiring.send(svc, job, engine, remote)
            try:
                groups = self._groups(job, engine, remote)
            except BaseException:
                await acquiring.settle()  # who holds it for us: the failure abandons them
                raise
            job.state = PullState.READING
            if await self.reads.post_and_wait(job, engine, remote, groups, acquiring):
                return
            # A producer daemon restarted, or its pools changed, since we cached this.
            svc.peers.forget(msg.engine_id, msg.remote_engine_id)
        raise KvdError(f"engine {msg.remote_engine_id!r} keeps changing its pools or daemons")

    def _groups(self, job: PullJob, engine: Engine, remote: RemoteEngine
                ) -> dict[str, ProducerReads]:
        """The pull's descriptors, grouped by producer (kvd.planner.assembly)."""
        msg = job.msg
        if remote.compat != engine.compat:
            raise IncompatibleError(
                f"engine {msg.remote_engine_id!r} is incompatible with {msg.engine_id!r} "
                f"(model/dtype/layout differ: {remote.desc.model} {remote.desc.layout})")
        if not engine.live_ranks():
            raise KvdError(f"engine {msg.engine_id!r} left before its READs were posted")
        if engine.model.hybrid is not None:  # every KV-cache group, Mamba state included
            return hybrid.assemble_pull(engine, remote, msg)
        local_ids, remote_ids = match_tail(
            msg.local_block_ids, msg.remote_block_ids, engine.layout.block_size_tokens,
            remote.desc.layout.block_size_tokens, msg.num_tokens)
        return self._assemble(engine, remote, local_ids, remote_ids)

    def _assemble(self, engine: Engine, remote: RemoteEngine, local_ids, remote_ids
                  ) -> dict[str, ProducerReads]:
        return self._prepared(engine, remote).assemble(local_ids, remote_ids)

    def _prepared(self, engine: Engine, remote: RemoteEngine) -> PreparedPull:
        """The assembly's inputs, bound once per (engine, peer engine) and reused while
        they stay the same: the local pools and geometry (the engine's epoch changes
        with every rank that registers or leaves) and the handshake (identity: a new one
        is a new object) (issue 23.4: a small pull rebuilt them every time)."""
        key = (engine.engine_id, remote.desc.engine_id)
        hit = self._ready.get(key)
        m = self.svc.metrics
        if (hit is not None and hit[1] is remote and hit[2] is engine
                and hit[3] == engine.epoch):
            m.plan_cache_hits.inc()
            return hit[0]
        local = tuple(RankPool(r.rank, r.cache, r.first_layer, r.pool.addr, r.device_id)
                      for r in engine.live_ranks())
        owners = tuple(d.agent for d in remote.daemons.values())
        rpar, remote_pools = self._remote_pools(remote)
        plan, cached = self.plans.get(geometry(engine.model), rpar, engine.par)
        (m.plan_cache_hits if cached else m.plan_cache_misses).inc()
        prepared = prepare_pull(plan, local, remote_pools, owners)
        if len(self._ready) >= MAX_PREPARED:
            self._ready.clear()
        self._ready[key] = (prepared, remote, engine, engine.epoch)
        return prepared

    @staticmethod
    def _remote_pools(remote: RemoteEngine) -> tuple[Parallelism, dict[RankId, RankPool]]:
        """The remote engine's parallelism and rank pools, built once per handshake."""
        if remote.pools is None:
            rdesc = remote.desc
            rpar = parallelism(rdesc.tp_size, rdesc.pp_size, rdesc.layer_partition)
            pools = {}
            for rid, rr in remote.ranks.items():
                cache, first = rank_layout(rdesc.model, rdesc.layout, rpar, rid.pp_rank,
                                           rr.desc.num_blocks)
                pools[rid] = RankPool(rid, cache, first, rr.desc.base_addr, rr.desc.device_id,
                                      owner=rr.agent)
            remote.pools = (rpar, pools)
        return remote.pools

    async def _abandon(self, msg: P.Pull, addrs: list[str]) -> None:
        note = P.Abandon(request_id=msg.producer_request_id,
                         producer_engine_id=msg.remote_engine_id,
                         consumer_engine_id=msg.engine_id)
        for addr in addrs:
            try:
                await self.svc.peers.request(addr, note)
            except KvdError as exc:
                log.info("abandon to %s not delivered (%s); the lease will release it", addr,
                         exc, extra={"request_id": msg.request_id, "peer": addr})


    def status(self) -> list[P.PullStatus]:
        now = self.svc.clock.now()
        return [P.PullStatus(engine_id=j.msg.engine_id, request_id=j.msg.request_id,
                             state=j.state.value, age_s=round(now - j.started_s, 3),
                             remote_engine_id=j.msg.remote_engine_id, nbytes=j.nbytes)
                for j in self.jobs.values()]

"""Consumer side: admission of every pull, its mover, its plan cache, status.

A pull is one `Pull` (kvd.daemon.pull.machine: the record and every decision, over the
transition table in kvd.daemon.pull.state) carried out by one `PullDriver`
(kvd.daemon.pull.driver: inline in the engine's request, then in the pull's task) with
the mover chosen here (kvd.daemon.pull.movers), its descriptors from
kvd.daemon.pull.assemble. Its states:

    queued --early_acquire--> acquiring
    queued --wait_ranks--> waiting_ranks
    queued --fail--> failing
    waiting_ranks --handshake--> handshaking
    waiting_ranks --fail--> failing
    handshaking --acquire--> acquiring
    handshaking --fail--> failing
    acquiring --post--> reading
    acquiring --stale--> waiting_ranks
    acquiring --finish--> releasing
    acquiring --fail--> failing
    reading --discard--> discarding
    reading --stale--> waiting_ranks
    reading --finish--> releasing
    reading --quarantine--> quarantined
    reading --fail--> failing
    discarding --post--> reading
    discarding --stale--> waiting_ranks
    discarding --quarantine--> quarantined
    discarding --fail--> failing
    releasing --released--> done
    failing --released--> failed
    quarantined --fail--> failing

A producer found restarted or gone while the pull depends on it fails the pull with
``peer_lost``; the cached handshake is dropped so the next pull greets the new
incarnation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from kvd.daemon import hybrid
from kvd.daemon.engines.table import Engine, check_block_ids
from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.pull.assemble import PullAssembler
from kvd.daemon.pull.driver import Peers, PullDriver
from kvd.daemon.pull.hostmap import HostMapper, HostMaps
from kvd.daemon.pull.local import Dispatch, LocalMover, LocalPeers, local_copier
from kvd.daemon.pull.machine import Pull
from kvd.daemon.pull.movers import NixlMover
from kvd.daemon.pull.progressive import Progressive, ProgressiveRunner
from kvd.daemon.pull.quarantine import QuarantineCounts
from kvd.daemon.pull.state import FINISHED_KEEP, FINISHED_KEEP_S, Path
from kvd.daemon.pull.warmup import REGAIN_S, warm_producers
from kvd.daemon.services import Services
from kvd.errors import (
    BlockIdError,
    BusyError,
    KvdError,
    TooLargeError,
    TransferError,
)
from kvd.ops.trace import PHASE_POINT, TRACE
from kvd.transport.base import Copier, Mover
from kvd.transport.samehost.discovery import host_facts, local_host_names, names_this_daemon
from kvd.wire import protocol as P

log = logging.getLogger("kvd.consumer")

MAX_NAMED = 256  # remote addresses whose "is it me?" answer is kept; cleared past it


class Route(NamedTuple):
    """How a pull reaches its producer: the mover of its bytes and the peers it asks."""

    mover: Mover
    peers: Peers


def _cuda_copier() -> Copier:
    from kvd.transport.copies.cudacopy import CudaCopier

    return CudaCopier()


class Consumer:
    """Every pull of this daemon's engines: admission, the mover, the plan cache, status."""

    def __init__(self, svc: Services, local_dispatch: Dispatch | None = None) -> None:
        self.svc = svc
        # every pull in flight, by (engine, request): its driver, which holds its Pull
        self.pulls: dict[tuple[str, str], PullDriver] = {}
        self.finished: deque[Pull] = deque(maxlen=FINISHED_KEEP)
        # Progressive pulls (kvd.daemon.pull.progressive): each reads its ranges as pulls
        self.progressive: dict[tuple[str, str], ProgressiveRunner] = {}
        self.assembler = PullAssembler(svc.metrics)
        self.quarantine = QuarantineCounts(svc.cfg, svc.metrics)
        cfg = svc.cfg
        own_ports = tuple(sorted({p for p in (_port(cfg.peer_address), _port(cfg.engine_address),
                                              cfg.metrics_port) if p}))
        self._nixl = NixlMover(svc.datapath, svc.peers, own_ports)
        self._remote = Route(self._nixl, svc.peers)
        self._copier = local_copier(cfg.copy_threads)
        # Another daemon on this host whose pool files map here: copied, like a local pull,
        # with the control messages still going to that daemon (kvd.daemon.pull.hostmap).
        self._host_mover = LocalMover(self._copier)
        self._host_mover.path = Path.HOST
        self.hosts = HostMapper(host_facts(cfg.shm_dir), enabled=cfg.host_pulls)
        self._local: Route | None = None
        self._local_movers = [self._host_mover]
        if local_dispatch is not None:
            own = cfg.peer_advertise or cfg.peer_address
            local_mover = LocalMover(self._copier, cuda_copier=_cuda_copier)
            self._local_movers.append(local_mover)
            if cfg.device == "cuda":  # its kernels compile now, off the loop
                local_mover.start_cuda()
            self._local = Route(
                local_mover,
                LocalPeers(svc.registry, local_dispatch, own, svc.datapath.agent_name,
                           svc.instance_id, svc.clock.now))
        self._own_addresses = tuple(a for a in (cfg.peer_address, cfg.peer_advertise) if a)
        self._local_hosts = local_host_names()
        self._names_me: dict[str, bool] = {}
        svc.peers.on_regained = self.regained

    def regained(self, pairs: list[tuple[str, str, str]]) -> None:
        """Handshakes a dropped connection took (kvd.daemon.peers.table: liveness lost
        it, a stall of ours as well as a partition), made again in the background now
        that it is back, as a `WarmUp` would: (engine, producer engine, address).
        Engines gone meanwhile are skipped; the others are tried for up to REGAIN_S."""
        for engine_id, producer_id, address in pairs:
            if engine_id in self.svc.registry.engines:
                self.svc.spawn(warm_producers(
                    self.warm_pair, self.svc.clock, engine_id,
                    [P.Producer(engine_id=producer_id, address=address)], REGAIN_S))

    def copy_bursts(self, more_waiting: Callable[[], bool]) -> None:
        """Local and same-host pulls read in a burst copy together when the burst has
        been read (kvd.daemon.pull.burst); ``more_waiting``: requests wait on the face."""
        for mover in self._local_movers:
            mover.more_waiting = more_waiting

    async def warm_local(self, engine_id: str) -> None:
        """An engine registered: what a local pull between it and every other engine
        here would otherwise do first on its path (the in-process handshake, the plan
        and the prepared assembly), done now, both ways. Pairs that cannot pull from
        each other (incompatible, not every rank here yet) are skipped."""
        if self._local is None:
            return
        registry, peers = self.svc.registry, self._local.peers
        assert isinstance(peers, LocalPeers)
        own = self.svc.cfg.peer_advertise
        engine = registry.engines.get(engine_id)
        if engine is None or engine.missing_ranks(own) or not engine.live_ranks():
            return
        for other in list(registry.engines.values()):
            if other is engine or other.compat != engine.compat or other.missing_ranks(own) \
                    or not other.live_ranks():
                continue
            for consumer, producer in ((engine, other), (other, engine)):
                try:
                    remote = await peers.remote_engine(consumer, producer.engine_id,
                                                       peers.address)
                    self.assembler.prepare(consumer, remote)
                except KvdError as exc:  # the pull meets it again, and reports it
                    log.debug("local pair %s <- %s not warmed: %s", consumer.engine_id,
                              producer.engine_id, exc)

    async def warm_pair(self, engine_id: str, producer_id: str, address: str) -> bool:
        """A `WarmUp`'s producer (kvd.daemon.pull.warmup): what the pair's first pull
        would do first, done now (the handshake, the mover's choice with its host
        mappings, the prepared assembly; over NIXL, the lists of its READs' chunk).
        False: not possible yet (an engine not registered, or not every rank);
        KvdError: refused (unreachable...), retried."""
        registry, own = self.svc.registry, self.svc.cfg.peer_advertise
        engine = registry.engines.get(engine_id)
        if engine is None or engine.missing_ranks(own) or not engine.live_ranks():
            return False
        route = self.route_for_address(address)
        if route is self._local:  # this daemon's own: warmed when the later one registered
            producer = registry.engines.get(producer_id)
            if producer is None or producer.missing_ranks(own):
                return False
            await self.warm_local(engine_id)
            return True
        remote = await route.peers.remote_engine(engine, producer_id, address)
        picked = self.pick(remote)
        if picked is None:  # its mappings were retired meanwhile
            route.peers.forget(engine_id, producer_id)
            return False
        self.assembler.prepare(engine, remote)
        sample = self.assembler.sample(engine, remote)
        if picked[0] is self._nixl and sample is not None:
            try:  # NIXL READs: the lists of the pair's chunk too
                await self._nixl.prepare(engine, remote, sample)
            except TransferError as exc:  # the first post prepares them, as it would
                log.info("NIXL lists of %s <- %s not prepared ahead: %s", engine_id,
                         producer_id, exc)
        return True

    def route_for(self, msg: P.Pull) -> Route:
        """A pull's route, the first of the two steps that choose its mover (the second is
        `pick`): see `route_for_address`."""
        return self.route_for_address(msg.remote_address)

    def route_for_address(self, address: str) -> Route:
        """A producer daemon address that names this very daemon, however it is spelled
        (loopback or advertised, a wildcard bind), is a local pull, with this daemon's
        own producer side as its peers; any other goes over the network."""
        if self._local is None:
            return self._remote
        me = self._names_me.get(address)
        if me is None:
            me = names_this_daemon(address, self._own_addresses, self._local_hosts)
            if len(self._names_me) >= MAX_NAMED:
                self._names_me.clear()
            self._names_me[address] = me
        return self._local if me else self._remote

    def pick(self, remote: RemoteEngine) -> tuple[Mover, HostMaps | None] | None:
        """The second step, for a network pull: its mover, once its handshake is known
        (cached at the pull's start, or fresh after its greeting): the host path when
        the producer daemon is on this host and its pool files map here (decided once
        per handshake, `HostMapper.choose`), else NIXL READs. Also the mappings the
        pull must pin while it may copy. None: the handshake's mappings were retired
        meanwhile (its producer freed a pool): greet again."""
        route = self.hosts.choose(remote)
        if route is None:
            return None
        if route.maps is not None:
            return self._host_mover, route.maps
        return self._nixl, None

    def housekeeping(self) -> None:
        """Unmap what no cached handshake uses any more (dropped, replaced, or a pool its
        producer freed: that handshake is forgotten too)."""
        peers = self.svc.peers
        for stale in self.hosts.sweep(peers.remotes.values()):
            for key, remote in list(peers.remotes.items()):
                if remote is stale:
                    log.info("pool files of %s were freed by its daemon: handshake dropped",
                             key[1])
                    peers.forget(*key)

    def close(self) -> None:
        """Copies end first (the movers wait for them), then the mappings go."""
        self._host_mover.close()
        if self._local is not None:
            self._local.mover.close()
        self.hosts.close()

    def start(self, msg: P.Pull, reply_to: tuple[bytes, int] | None = None,
              events: object | None = None) -> None:
        """Validate cheaply and queue; the outcome arrives later as a done_recving event,
        queued for the engine's polls or, with ``reply_to`` (identity, request id), sent
        as the answer to that one request. ``events``: where a progressive pull's range
        pull reports instead (its runner)."""
        cfg = self.svc.cfg
        engine = self.svc.registry.get(msg.engine_id)
        if (msg.engine_id, msg.request_id) in self.pulls or (
                msg.engine_id, msg.request_id) in self.progressive:
            raise KvdError(f"request {msg.request_id!r} is already being pulled")
        if msg.progressive:
            self._start_progressive(msg, engine, reply_to)
            return
        if len(self.pulls) >= cfg.max_inflight_pulls:
            raise BusyError(f"{len(self.pulls)} pulls in flight (max_inflight_pulls)")
        for name, ids in (("local", msg.local_block_ids), ("remote", msg.remote_block_ids)):
            if len(ids) > cfg.max_blocks_per_request:
                raise TooLargeError(f"{len(ids)} {name} blocks exceed max_blocks_per_request "
                                    f"({cfg.max_blocks_per_request})")
        check_block_ids(msg.local_block_ids, engine.layout.num_blocks, "local")
        negative = [b for b in msg.remote_block_ids if b < 0]
        if negative:
            raise BlockIdError(f"remote block ids {negative[:8]} are negative")
        hybrid.check_pull(engine.model, msg)
        route = self.route_for(msg)
        pull = Pull(msg=msg, started_s=self.svc.clock.now(), reply_to=reply_to,
                    path=route.mover.path, liveness_timeout_s=cfg.peer_liveness_timeout_s,
                    transfer_timeout_s=cfg.transfer_timeout_s)
        if self.svc.spans is not None or TRACE.on:  # its phases noted (kvd.ops.otel)
            pull.marks, pull.marks_clock = [], self.svc.clock.now
        self.svc.metrics.inflight_transfers.inc()
        svc = self.svc if events is None else dataclasses.replace(self.svc, events=events)
        driver = PullDriver(svc, pull, route.mover, route.peers, self.quarantine,
                            self.assembler, self._reported,
                            pick=self.pick if route is self._remote else None)
        self.pulls[pull.key] = driver
        if not driver.run_now(engine, self._cached(msg, engine, route.peers)):
            driver.task = self.svc.spawn(driver.run())

    def _start_progressive(self, msg: P.Pull, engine: Engine,
                           reply_to: tuple[bytes, int] | None) -> None:
        """A progressive pull: its runner watches the producer and starts a pull per
        sealed range; one done_recving reports the whole."""
        cfg = self.svc.cfg
        if msg.remote_block_ids or msg.remote_group_block_ids:
            raise BlockIdError("a progressive pull names no remote blocks: the producer's "
                               "seals do")
        if len(self.pulls) + len(self.progressive) >= cfg.max_inflight_pulls:
            raise BusyError(f"{len(self.pulls)} pulls in flight (max_inflight_pulls)")
        if len(msg.local_block_ids) > cfg.max_blocks_per_request:
            raise TooLargeError(f"{len(msg.local_block_ids)} local blocks exceed "
                                f"max_blocks_per_request ({cfg.max_blocks_per_request})")
        check_block_ids(msg.local_block_ids, engine.layout.num_blocks, "local")
        hybrid.check_group_ids(engine.model, msg.local_block_ids, msg.local_group_block_ids,
                               "pull (local)")
        prog = Progressive(msg=msg, local_block_tokens=engine.layout.block_size_tokens,
                           started_s=self.svc.clock.now(),
                           hold_timeout_s=msg.hold_timeout_s or cfg.progressive_hold_s,
                           hybrid=engine.model.hybrid is not None)
        route = self.route_for(msg)

        def report(p: Progressive, event: P.Event) -> None:
            self.progressive.pop(p.key, None)
            if reply_to is not None:
                self.svc.events.answer(*reply_to, event)
            else:
                self.svc.events.push(msg.engine_id, event)
            if not event.ok:
                log.warning("progressive pull failed: %s", event.error,
                            extra={"request_id": msg.request_id, "engine_id": msg.engine_id,
                                   "peer": msg.remote_address})

        runner = ProgressiveRunner(
            prog, route.peers, self.svc, engine,
            lambda child, answer: self.start(child, events=answer), report)
        self.progressive[prog.key] = runner
        runner.task = self.svc.spawn(runner.run())

    def cancel(self, engine_id: str, request_id: str) -> None:
        """The engine cancels a progressive pull: it reports (not ok) once nothing of it
        can land any more. Nothing to do for an ordinary or finished one."""
        runner = self.progressive.get((engine_id, request_id))
        if runner is not None:
            runner.cancel()

    def _cached(self, msg: P.Pull, engine: Engine, peers: Peers) -> RemoteEngine | None:
        """The cached handshake, when every rank of the engine is here: then the Acquire
        leaves now, before the pull's task even starts (its round trip overlaps the rest)."""
        svc = self.svc
        remote = peers.cached(msg.engine_id, msg.remote_engine_id, msg.remote_address)
        if remote is None or engine.missing_ranks(svc.cfg.peer_advertise):
            return None
        return remote

    def _reported(self, pull: Pull) -> None:
        self.pulls.pop(pull.key, None)
        self.finished.append(pull)
        if self.svc.spans is not None:
            self.svc.spans.pull_ended(pull, self.svc.clock.now())
        if TRACE.on:
            trace_phases(pull)

    def cancel_all(self, reason: KvdError) -> list[asyncio.Task[None]]:
        """Fail every pull now (drain timeout): each releases its transfers, then reports."""
        tasks = []
        for runner in self.progressive.values():
            runner.cancel()
            if runner.task is not None and not runner.task.done():
                tasks.append(runner.task)
        for driver in list(self.pulls.values()):
            task = driver.task
            if task is not None and not task.done():
                driver.pull.cancel_reason = reason
                task.cancel()
                tasks.append(task)
        return tasks

    def status(self) -> tuple[list[P.PullStatus], list[P.PullStatus]]:
        """Pulls in flight, and the last ones finished (for ``FINISHED_KEEP_S``)."""
        now = self.svc.clock.now()
        while self.finished and now - self.finished[0].finished_s > FINISHED_KEEP_S:
            self.finished.popleft()
        return ([_row(d.pull, now) for d in self.pulls.values()],
                [_row(p, now) for p in self.finished])


def _row(p: Pull, now: float) -> P.PullStatus:
    return P.PullStatus(engine_id=p.msg.engine_id, request_id=p.msg.request_id,
                        state=p.state.value, age_s=round(now - p.started_s, 3),
                        remote_engine_id=p.msg.remote_engine_id, nbytes=p.nbytes,
                        path=p.path, error=p.error)


def _port(address: str) -> int:
    """The port of a "tcp://host:port" endpoint (0 when there is none)."""
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() and "://" in address else 0


def trace_phases(pull: Pull) -> None:
    """With KVD_TRACE_DIR set (kvd.ops.trace), a reported pull's phases, each as seconds
    after the daemon took it (``daemon_phase_<transition>``: greeted, acquired, posted,
    every transfer ended...), and each post's time in the transport (``daemon_post``:
    build plus transfer call), for ``kvd bench vllm --breakdown``."""
    rid = pull.msg.request_id
    for name, at_s in pull.marks or ():
        TRACE.point(PHASE_POINT + name, rid, at_s - pull.started_s)
    for post_s, _descriptors, _timings in pull.post_records:
        TRACE.point("daemon_post", rid, post_s)

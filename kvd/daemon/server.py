"""The daemon: two ZMQ ROUTER faces, one NIXL thread, and the loops that tie them.

Composition only: decoding lives in kvd.protocol, planning in kvd.planner,
request lifecycles in producer/consumer, NIXL in the data path. Every handler
either replies or raises a KvdError that becomes an Error reply; nothing a
client or peer sends can stop the loops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from kvd import __version__
from kvd import protocol as P
from kvd.config import Config
from kvd.daemon.consumer import Consumer
from kvd.daemon.datapath import DataPath, new_nixl_executor
from kvd.daemon.engines import Engine, EngineRank, EngineTable, validate_registration
from kvd.daemon.events import EventHub
from kvd.daemon.peers import PeerTable, RemoteEngine
from kvd.daemon.producer import Producer
from kvd.errors import (
    BusyError,
    DrainingError,
    IncompatibleError,
    KvdError,
    KvdTimeoutError,
    ProtocolError,
)
from kvd.metrics import Metrics
from kvd.planner import RankId
from kvd.pool import ShmPool
from kvd.transport.base import Transport

log = logging.getLogger("kvd.daemon")


class Daemon:
    def __init__(self, cfg: Config, transport_factory: Callable[[], Transport] | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None,
                 token: str = "") -> None:
        self.cfg = cfg
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.daemon_id = uuid.uuid4().hex[:12]
        self.token = token
        self._transport_factory = transport_factory
        self.engines = EngineTable(cfg.max_engines)
        self.producer = Producer(self)
        self.consumer = Consumer(self)
        self.events = EventHub(self._reply_poll, clock)
        self.draining = False
        self.ready = False
        self._tasks: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self._wake = asyncio.Event()  # publish/acquire: READ notices may come soon, poll now
        self._collect_lock = asyncio.Lock()
        self.http = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from kvd.httpserver import start_http_server

        self.ctx = zmq.asyncio.Context()
        factory = self._transport_factory or self._nixl_factory
        # Creating the agent takes ~0.5 s: do it on the NIXL thread, like every NIXL call.
        executor = new_nixl_executor()
        transport = await asyncio.get_running_loop().run_in_executor(executor, factory)
        self.datapath = DataPath(transport, executor)
        self.peers = PeerTable(self.ctx, self.token, self.cfg.max_message_bytes,
                               self.cfg.handshake_timeout_s)
        self.engine_sock = self._bind(self.cfg.engine_address)
        self.peer_sock = self._bind(self.cfg.peer_address)
        self.spawn(self._serve(self.engine_sock, "engine", P.ENGINE_REQUESTS))
        self.spawn(self._serve(self.peer_sock, "peer", P.PEER_REQUESTS))
        self.spawn(self._progress())
        self.spawn(self._housekeeping())
        if self.cfg.metrics_port:
            self.http = start_http_server(self.cfg.metrics_host, self.cfg.metrics_port,
                                          self.metrics.registry, self._ready)
        self.ready = True
        log.info("kvd %s serving: engine %s, peer %s (advertised %s), agent %s", __version__,
                 self.cfg.engine_address, self.cfg.peer_address, self.cfg.peer_advertise,
                 self.datapath.agent_name)

    def _nixl_factory(self) -> Transport:
        from kvd.transport.nixl import NixlTransport

        return NixlTransport(name=f"kvd-{self.daemon_id}", backend=self.cfg.nixl_backend,
                             progress_thread=self.cfg.nixl_progress_thread)

    def _bind(self, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.bind(address)
        return sock

    def _ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, "starting"
        return True, f"serving {self.engines.rank_count()} engine ranks"

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let held requests and pulls end (bounded), then stop."""
        self.draining = True
        log.info("draining: %d held, %d pulls", len(self.producer.held), len(self.consumer.jobs))
        deadline = self.clock() + self.cfg.drain_timeout_s
        while (self.producer.held.items or self.consumer.jobs) and self.clock() < deadline:
            await asyncio.sleep(0.05)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        self.ready = False
        self.draining = True
        for held in list(self.producer.held.items.values()):
            self.producer.finish(held, "cancelled")
        self.events.flush_all()
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        await asyncio.gather(*[t for t in self._tasks if t is not current],
                             return_exceptions=True)
        for engine in list(self.engines.engines.values()):
            for rank_id in list(engine.ranks):
                self.engines.mark_gone(engine.engine_id, rank_id)
        for rank in self.engines.retired:
            rank.pins = 0  # every transfer task was cancelled and released above
        await self._collect_pools()
        self.shutdown_counts = await self.datapath.counts()
        log.info("shutdown balance: registrations=%d transfers=%d (must be 0), peers=%d",
                 self.shutdown_counts.registrations, self.shutdown_counts.transfers,
                 self.shutdown_counts.peers)
        await self.datapath.close()
        self.peers.close()
        self.engine_sock.close(0)
        self.peer_sock.close(0)
        self.ctx.term()
        if self.http is not None:
            self.http.close()
        log.info("kvd stopped")

    # ------------------------------------------------------------ faces

    async def _serve(self, sock: zmq.asyncio.Socket, face: str, allowed: tuple[type, ...]) -> None:
        handlers = self._engine_handlers if face == "engine" else self._peer_handlers
        while True:
            frames = await sock.recv_multipart()
            identity, payload = frames[0], frames[1:]
            msg_id = 0
            try:
                header, body = P.decode(payload, allowed)
                msg_id = header.id
                if self.token and not hmac.compare_digest(header.token.encode(),
                                                          self.token.encode()):
                    self.metrics.auth_failures.labels(face=face).inc()
                    self._send(sock, identity, msg_id,
                               P.Error(code="unauthorized", message="bad or missing token"))
                    continue
                reply = await handlers[type(body)](body, identity, msg_id)
            except ProtocolError as exc:
                self.metrics.protocol_error(face, getattr(exc, "reason", "decode"))
                reply = P.Error(code=exc.code, message=str(exc))
                if not msg_id and len(payload) == 2:
                    # Echo the id whenever the header itself decodes (another version, an
                    # unknown kind, a bad body), so the sender can match the Error to its call.
                    try:
                        msg_id = P.decode_header(payload[0]).id
                    except ProtocolError:
                        pass
            except KvdError as exc:
                if isinstance(exc, BusyError):
                    self.metrics.busy_rejections.inc()
                reply = P.Error(code=exc.code, message=str(exc))
            except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the face
                log.exception("handler failed on the %s face", face)
                reply = P.Error(code="internal", message=f"internal error: {exc!r}")
            if reply is not None:
                self._send(sock, identity, msg_id, reply)

    def _send(self, sock: zmq.asyncio.Socket, identity: bytes, msg_id: int, body: Any) -> None:
        try:
            sock.send_multipart([identity, *P.encode(body, msg_id)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply dropped: %s", exc)

    def _reply_poll(self, identity: bytes, msg_id: int, events: P.Events) -> None:
        self._send(self.engine_sock, identity, msg_id, events)

    @property
    def _engine_handlers(self) -> dict[type, Callable]:
        return {
            P.RegisterEngine: self._on_register,
            P.Deregister: self._on_deregister,
            P.Ping: self._on_ping,
            P.Publish: self._on_publish,
            P.Pull: self._on_pull,
            P.Poll: self._on_poll,
            P.StatusQuery: self._on_status,
        }

    @property
    def _peer_handlers(self) -> dict[type, Callable]:
        return {P.Hello: self._on_hello, P.Acquire: self._on_acquire,
                P.Heartbeat: self._on_heartbeat, P.Abandon: self._on_abandon}

    # ------------------------------------------------------------ engine face

    async def _on_register(self, msg: P.RegisterEngine, *_: Any) -> P.Registered:
        if self.draining:
            raise DrainingError("daemon is draining; register with another kvd")
        par, cache, first = validate_registration(msg)
        self.engines.check_joinable(msg, par)
        if self.engines.rank_count() >= self.cfg.max_engines:
            raise BusyError(f"{self.engines.rank_count()} engine ranks registered (max_engines)")
        pool, mem_type, device_id = self._allocate(msg, cache.total_nbytes)
        try:
            reg_id = await self.datapath.register(pool.addr, pool.nbytes, mem_type, device_id)
        except Exception:
            pool.close()
            raise
        rank = EngineRank(engine_id=msg.engine_id, rank=RankId(msg.tp_rank, msg.pp_rank), msg=msg,
                          cache=cache, first_layer=first, pool=pool, reg_id=reg_id,
                          last_seen_s=self.clock(), device_id=device_id)
        self.engines.add(msg, par, rank, mem_type)
        self.metrics.pool_bytes.inc(pool.nbytes)
        self.metrics.engines.set(self.engines.rank_count())
        log.info("registered engine %s rank %s (%d bytes)", msg.engine_id, rank.rank.key,
                 pool.nbytes, extra={"engine_id": msg.engine_id})
        return P.Registered(pool=pool.handle(cache.shape, msg.model.dtype),
                            daemon_id=self.daemon_id, peer_address=self.cfg.peer_advertise)

    def _allocate(self, msg: P.RegisterEngine, nbytes: int) -> tuple[Any, str, int]:
        """(pool, NIXL memory type, device id): shm in DRAM, or VRAM on the rank's GPU."""
        if self.cfg.device == "cuda":
            from kvd.cuda_pool import CudaPool

            return CudaPool.create(self.cfg.shm_prefix, nbytes, msg.device_index), "VRAM", \
                msg.device_index
        return ShmPool.create(self.cfg.shm_prefix, nbytes, self.cfg.shm_dir), "DRAM", 0

    async def _on_deregister(self, msg: P.Deregister, *_: Any) -> P.Ok:
        self._rank_gone(msg.engine_id, RankId(msg.tp_rank, msg.pp_rank), "deregistered")
        return P.Ok()

    def _rank_gone(self, engine_id: str, rank: RankId, why: str) -> None:
        gone = self.engines.mark_gone(engine_id, rank)
        if gone is None:
            raise KvdError(f"engine {engine_id!r} rank {rank.key} is not registered")
        log.info("engine %s rank %s %s", engine_id, rank.key, why,
                 extra={"engine_id": engine_id})
        engine = self.engines.engines.get(engine_id)
        if engine is None or not engine.ranks:
            self.producer.engine_gone(engine_id)
        self.metrics.engines.set(self.engines.rank_count())

    async def _on_ping(self, msg: P.Ping, *_: Any) -> P.Ok:
        engine = self.engines.get(msg.engine_id)
        rank = engine.ranks.get(RankId(msg.tp_rank, msg.pp_rank))
        if rank is None or rank.gone:
            raise KvdError(f"engine {msg.engine_id!r} rank {msg.tp_rank}/{msg.pp_rank} is not "
                           "registered (daemon restarted?): register again")
        rank.last_seen_s = self.clock()
        return P.Ok()

    async def _on_publish(self, msg: P.Publish, *_: Any) -> P.Ok:
        if self.draining:
            raise DrainingError("daemon is draining; not accepting new publishes")
        self.producer.publish(msg)
        self._wake.set()
        return P.Ok()

    async def _on_pull(self, msg: P.Pull, *_: Any) -> P.Ok:
        if self.draining:
            raise DrainingError("daemon is draining; not accepting new pulls")
        self.consumer.start(msg)
        return P.Ok()

    async def _on_poll(self, msg: P.Poll, identity: bytes, msg_id: int) -> None:
        if msg.engine_id not in self.engines.engines:
            raise KvdError(f"engine {msg.engine_id!r} is not registered on this daemon")
        self.events.wait(msg.engine_id, identity, msg_id, msg.timeout_s, msg.max_events)
        return None

    async def _on_status(self, *_: Any) -> P.Status:
        engines = []
        for e in self.engines.engines.values():
            for r in [*e.ranks.values(), *(x for x in self.engines.retired
                                          if x.engine_id == e.engine_id)]:
                engines.append({"engine_id": e.engine_id, "rank": r.rank.key,
                                "tp_size": e.par.tp_size, "pp_size": e.par.pp_size,
                                "pool": r.pool.name, "pool_bytes": r.pool.nbytes,
                                "gone": r.gone, "pins": r.pins})
        peers = [{"address": addr, "local_engine": k[0], "remote_engine": k[1], "agent": agent}
                 for k, remote in self.peers.remotes.items()
                 for addr, agent in remote.daemons.items()]
        return P.Status(daemon_id=self.daemon_id, version=__version__, draining=self.draining,
                        engines=engines, peers=peers, held=self.producer.status(),
                        pulls=self.consumer.status())

    # ------------------------------------------------------------ peer face

    async def _on_hello(self, msg: P.Hello, *_: Any) -> P.HelloReply:
        engine = self.engines.get(msg.remote_engine_id)
        if msg.compat_hash != engine.compat:
            raise IncompatibleError(
                f"engine {engine.engine_id!r} here is incompatible with consumer "
                f"{msg.consumer.engine_id!r}: model/dtype/layout differ "
                f"({engine.model} {engine.layout} vs {msg.consumer.model} {msg.consumer.layout})")
        self.producer.consumers[msg.consumer.engine_id] = msg.consumer
        return P.HelloReply(daemon_id=self.daemon_id, agent_name=self.datapath.agent_name,
                            agent_metadata=await self.datapath.metadata(), engine=engine.desc(),
                            engine_daemons=list(engine.engine_daemons))

    async def _on_acquire(self, msg: P.Acquire, *_: Any) -> P.Acquired:
        reply = self.producer.acquire(msg)
        self._wake.set()
        return reply

    async def _on_heartbeat(self, msg: P.Heartbeat, *_: Any) -> P.HeartbeatAck:
        return self.producer.heartbeat(msg)

    async def _on_abandon(self, msg: P.Abandon, *_: Any) -> P.Ok:
        return self.producer.abandon(msg)

    # ------------------------------------------------------------ consumer helpers

    async def handshake(self, engine: Engine, remote_engine_id: str,
                        address: str) -> RemoteEngine:
        async def hello() -> P.Hello:
            return P.Hello(daemon_id=self.daemon_id, remote_engine_id=remote_engine_id,
                           consumer=engine.desc(), agent_metadata=b"",
                           compat_hash=engine.compat)

        start = time.perf_counter()
        try:
            remote, hit = await self.peers.remote_engine(
                engine.engine_id, remote_engine_id, address, hello, self.datapath.load_peer)
        except KvdTimeoutError as exc:
            if not getattr(exc, "counted", False):  # pulls sharing one handshake share its error
                exc.counted = True  # type: ignore[attr-defined]
                self.metrics.handshakes.labels(outcome="timeout").inc()
                self.peers.drop(address)
            raise
        except (IncompatibleError, KvdError) as exc:
            outcome = "refused" if exc.code in ("incompatible", "not_found", "unauthorized") \
                else "failed"
            if not getattr(exc, "counted", False):
                exc.counted = True  # type: ignore[attr-defined]
                self.metrics.handshakes.labels(outcome=outcome).inc()
            raise
        if not hit:
            self.metrics.handshakes.labels(outcome="ok").inc()
            self.metrics.handshake_duration.observe(time.perf_counter() - start)
            self.metrics.peers.set(len({a for r in self.peers.remotes.values() for a in r.daemons}))
        return remote

    # ------------------------------------------------------------ loops

    async def _progress(self) -> None:
        """Drive NIXL on the producer side: collect READ notices, adaptively.

        A consumer's READ (it carries the notice) is not DONE on its side until this
        daemon polls, so poll every 0.25 ms for 5 ms after a publish/acquire/notice,
        then back off: to 2 ms while some acquired request is being read, to 50 ms when
        nothing is (an idle or merely holding daemon costs ~1% of a core, not one core).
        """
        fast_s, hot_window_s = 0.00025, 0.005
        interval_s, last_activity_s = fast_s, time.monotonic()
        while True:
            try:
                notices = await self.datapath.notifications()
                for agent, raw in notices:
                    self.producer.on_notification(agent, raw)
            except Exception:  # noqa: BLE001
                log.exception("notification poll failed")
                notices = []
            now_s = time.monotonic()
            if notices:
                last_activity_s = now_s
            if now_s - last_activity_s < hot_window_s:
                interval_s = fast_s  # a READ is likely landing right now
            else:
                cap_s = 0.002 if self.producer.reading else 0.05
                interval_s = min(interval_s * 2, cap_s)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), interval_s)
                interval_s, last_activity_s = fast_s, time.monotonic()
            except asyncio.TimeoutError:
                pass

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            try:
                now = self.clock()
                self.producer.expire(now)
                self.events.expire()
                self._expire_engines(now)
                await self._collect_pools()
            except Exception:  # noqa: BLE001
                log.exception("housekeeping failed")

    def _expire_engines(self, now_s: float) -> None:
        timeout_s = self.cfg.engine_timeout_s
        for engine in list(self.engines.engines.values()):
            for rank in engine.live_ranks():
                if now_s - rank.last_seen_s > timeout_s:
                    self._rank_gone(engine.engine_id, rank.rank,
                                    f"silent for {timeout_s}s: treated as gone")

    async def _collect_pools(self) -> None:
        """Free retired, unpinned pools, shielded from cancellation.

        A rank leaves the retired list before its pool is deregistered; if stop() cancelled
        housekeeping during that await, the rank was lost and its pool never freed. The
        shielded collection finishes anyway, and stop() waits for it on the lock.
        """
        await asyncio.shield(self._collect_locked())

    async def _collect_locked(self) -> None:
        async with self._collect_lock:
            await self._collect_once()

    async def _collect_once(self) -> None:
        for rank in self.engines.collectable():
            await self.datapath.deregister(rank.reg_id)
            rank.pool.close()
            self.metrics.pool_bytes.dec(rank.pool.nbytes)
        self.events.forget_except(set(self.engines.engines))

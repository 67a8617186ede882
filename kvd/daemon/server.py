"""The daemon: composition and dispatch, nothing else.

Two ZMQ ROUTER faces feed one dispatch table; every other job has one owner:

    registration, allocation, liveness, pool freeing   kvd.daemon.registry
    handshakes and the peer cache                      kvd.daemon.peers
    publish, acquire, notices, progress, leases        kvd.daemon.producer
    pulls                                              kvd.daemon.consumer
    completion events                                  kvd.daemon.events
    every NIXL call                                    kvd.daemon.datapath

Each message is answered or raises a KvdError that becomes an Error reply; the
token is checked from the header before the body is decoded; nothing a client
or a peer sends can stop the loops (a handler bug is answered ``internal``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvd import __version__
from kvd import protocol as P
from kvd.config import Config
from kvd.daemon.clock import Clock, MonotonicClock
from kvd.daemon.consumer import Consumer
from kvd.daemon.datapath import DataPath, new_nixl_executor
from kvd.daemon.events import EventHub
from kvd.daemon.peers import PeerTable
from kvd.daemon.producer import Producer
from kvd.daemon.registry import EngineRegistry
from kvd.daemon.services import Services
from kvd.errors import (
    AuthError,
    BusyError,
    DrainingError,
    InternalError,
    KvdError,
    NotFoundError,
    ProtocolError,
)
from kvd.metrics import Metrics
from kvd.planner import RankId
from kvd.transport.base import Transport

log = logging.getLogger("kvd.daemon")

HOUSEKEEPING_INTERVAL_S = 0.05  # leases, poll timeouts, engine liveness, pool freeing
DRAIN_POLL_S = 0.05
DRAIN_RELEASE_TIMEOUT_S = 0.4  # after drain_timeout_s: pulls failed, their READs released
MIN_RECEIVE_HWM = 8  # messages queued per connection, at the least


@dataclass(frozen=True)
class Request:
    identity: bytes
    header: P.Header


Handler = Callable[[Any, Request], Awaitable[Any]]


class Daemon:
    def __init__(self, cfg: Config, transport_factory: Callable[[], Transport] | None = None,
                 clock: Clock | None = None, metrics: Metrics | None = None,
                 token: str = "") -> None:
        self.cfg = cfg
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or Metrics()
        self.daemon_id = uuid.uuid4().hex[:12]
        self.instance_id = uuid.uuid4().hex  # this incarnation; never reused
        self.token = token
        self._transport_factory = transport_factory
        self.events = EventHub(self._reply_poll, self.clock.now, self.metrics.events_dropped.inc,
                               schedule=self._call_soon)
        self.draining = self.ready = self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = asyncio.Event()
        self.http = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from kvd.httpserver import start_http_server

        self.ctx = zmq.asyncio.Context()
        factory = self._transport_factory or self._nixl_factory
        # Creating the agent takes ~0.5 s: do it on the NIXL thread, like every NIXL call.
        executor = new_nixl_executor()
        transport = await asyncio.get_running_loop().run_in_executor(executor, factory)
        self.datapath = DataPath(transport, executor, self.clock)
        self.registry = EngineRegistry(self.cfg, self.clock, self.metrics, self.datapath,
                                       self.daemon_id, self.instance_id)
        self.peers = PeerTable(self.ctx, self.cfg, self.clock, self.metrics, self.datapath,
                               self.token, self.daemon_id, self.instance_id)
        svc = Services(self.cfg, self.clock, self.metrics, self.datapath, self.registry,
                       self.peers, self.events, self.spawn, self.daemon_id, self.instance_id)
        self.producer, self.consumer = Producer(svc), Consumer(svc)
        self.engine_sock = self._bind(self.cfg.engine_address)
        self.peer_sock = self._bind(self.cfg.peer_address)
        self.spawn(self._serve(self.engine_sock, "engine", P.ENGINE_REQUESTS, self._engine_face()))
        self.spawn(self._serve(self.peer_sock, "peer", P.PEER_REQUESTS, self._peer_face()))
        self.spawn(self.producer.run_progress())
        self.spawn(self._housekeeping())
        if self.cfg.metrics_port:
            self.http = start_http_server(self.cfg.metrics_host, self.cfg.metrics_port,
                                          self.metrics.registry, self._ready)
        self.ready = True
        log.info("kvd %s serving: engine %s, peer %s (advertised %s), agent %s, instance %s",
                 __version__, self.cfg.engine_address, self.cfg.peer_address,
                 self.cfg.peer_advertise, self.datapath.agent_name, self.instance_id)

    def _nixl_factory(self) -> Transport:
        from kvd.transport.nixl import NixlTransport

        return NixlTransport(name=f"kvd-{self.daemon_id}", backend=self.cfg.nixl_backend,
                             progress_thread=self.cfg.nixl_progress_thread)

    def _bind(self, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        # The receive queue is bounded in bytes: at most receive_queue_bytes of messages
        # of the largest allowed size wait per connection (ZMQ counts messages).
        hwm = max(MIN_RECEIVE_HWM, self.cfg.receive_queue_bytes // self.cfg.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.bind(address)
        return sock

    def _ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, "starting"
        return True, f"serving {self.registry.rank_count()} engine ranks"

    @staticmethod
    def _call_soon(fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_soon(fn)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let held requests and pulls end within drain_timeout_s;
        then fail the pulls left (``draining``), release their READs, and stop."""
        self.draining = True
        log.info("draining: %d held, %d pulls", len(self.producer.held), len(self.consumer.jobs))
        deadline = self.clock.now() + self.cfg.drain_timeout_s
        while (self.producer.held.items or self.consumer.jobs) and self.clock.now() < deadline:
            await self.clock.sleep(DRAIN_POLL_S)
        failing = self.consumer.cancel_all(DrainingError(
            f"daemon stopped (drain_timeout_s={self.cfg.drain_timeout_s}) before the pull ended"))
        if failing:
            await asyncio.wait(failing, timeout=DRAIN_RELEASE_TIMEOUT_S)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        self.ready, self.draining, self._stopping = False, True, True
        self.producer.cancel_all()
        self.consumer.cancel_all(DrainingError("daemon stopped before the pull ended"))
        current = asyncio.current_task()
        while others := [t for t in self._tasks if t is not current and not t.done()]:
            for task in others:  # twice if cancelled pulls spawned an Abandon meanwhile
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        self.events.flush_all()
        await self.registry.release_all()
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

    async def _housekeeping(self) -> None:
        while True:
            await self.clock.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                now = self.clock.now()
                self.producer.expire(now)
                self.events.expire()
                self.registry.expire(now)
                await self.registry.collect()
                self.events.forget_except(set(self.registry.engines))
            except Exception:  # noqa: BLE001 - housekeeping must go on
                log.exception("housekeeping failed")

    # ------------------------------------------------------------ faces

    async def _serve(self, sock: zmq.asyncio.Socket, face: str, allowed: tuple[type, ...],
                     handlers: dict[type, Handler]) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            payload = [f.buffer for f in frames[1:]]
            msg_id = 0
            try:
                if len(payload) != 2:
                    raise ProtocolError(f"expected 2 frames, got {len(payload)}")
                try:
                    header = P.decode_header(payload[0])
                except ProtocolError:
                    # Reply to the right call even when the header does not decode.
                    msg_id = P.peek_id(bytes(payload[0]))
                    raise
                msg_id = header.id
                if self.token and not hmac.compare_digest(header.token.encode(),
                                                          self.token.encode()):
                    self.metrics.auth_failures.labels(face=face).inc()
                    raise AuthError("bad or missing token")
                body = P.decode_body(header, payload[1], allowed)
                reply = await handlers[type(body)](body, Request(identity, header))
            except ProtocolError as exc:
                self.metrics.protocol_error(face, exc.reason)
                if not msg_id and payload:
                    msg_id = P.peek_id(bytes(payload[0]))
                reply = P.Error(code=exc.code, message=str(exc))
            except KvdError as exc:
                if isinstance(exc, BusyError):
                    self.metrics.busy_rejections.inc()
                reply = P.Error(code=exc.code, message=str(exc))
            except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the face
                log.exception("handler failed on the %s face", face)
                reply = P.Error(code=InternalError.code, message=f"internal error: {exc!r}")
            if reply is not None:
                self._send(sock, identity, msg_id, reply)

    def _send(self, sock: zmq.asyncio.Socket, identity: bytes, msg_id: int, body: Any) -> None:
        try:
            sock.send_multipart([identity, *P.encode(body, msg_id, instance=self.instance_id)],
                                flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply dropped: %s", exc)

    def _reply_poll(self, identity: bytes, msg_id: int, events: P.Events) -> None:
        self._send(self.engine_sock, identity, msg_id, events)

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise DrainingError(f"daemon is draining; not accepting new {what}")

    def _engine_face(self) -> dict[type, Handler]:
        reg, producer, consumer = self.registry, self.producer, self.consumer

        async def register(m: P.RegisterEngine, _: Request) -> P.Registered:
            self._refuse_if_draining("registrations (register with another kvd)")
            return await reg.register(m)

        async def deregister(m: P.Deregister, _: Request) -> P.Ok:
            reg.deregister(m.engine_id, RankId(m.tp_rank, m.pp_rank))
            return P.Ok()

        async def ping(m: P.Ping, _: Request) -> P.Ok:
            reg.ping(m.engine_id, RankId(m.tp_rank, m.pp_rank))
            return P.Ok()

        async def publish(m: P.Publish, _: Request) -> P.Ok:
            self._refuse_if_draining("publishes")
            producer.publish(m)
            return P.Ok()

        async def pull(m: P.Pull, _: Request) -> P.Ok:
            self._refuse_if_draining("pulls")
            consumer.start(m)
            return P.Ok()

        async def poll(m: P.Poll, req: Request) -> None:
            if m.engine_id not in reg.engines:  # also after its last rank left: events remain
                raise NotFoundError(f"engine {m.engine_id!r} is not registered on this daemon")
            self.events.wait(m.engine_id, req.identity, req.header.id, m.timeout_s, m.max_events)

        async def status(_: P.StatusQuery, __: Request) -> P.Status:
            return P.Status(daemon_id=self.daemon_id, version=__version__,
                            draining=self.draining, engines=reg.status(),
                            peers=self.peers.status(), held=producer.status(),
                            pulls=consumer.status(), instance_id=self.instance_id)

        return {P.RegisterEngine: register, P.Deregister: deregister, P.Ping: ping,
                P.Publish: publish, P.Pull: pull, P.Poll: poll, P.StatusQuery: status}

    def _peer_face(self) -> dict[type, Handler]:
        producer = self.producer

        async def hello(m: P.Hello, _: Request) -> P.HelloReply:
            return await producer.hello(m)

        async def acquire(m: P.Acquire, req: Request) -> P.Acquired:
            return producer.acquire(m, req.header.instance)

        async def heartbeat(m: P.Heartbeat, _: Request) -> P.HeartbeatAck:
            return producer.heartbeat(m)

        async def abandon(m: P.Abandon, _: Request) -> P.Ok:
            return producer.abandon(m)

        return {P.Hello: hello, P.Acquire: acquire, P.Heartbeat: heartbeat, P.Abandon: abandon}

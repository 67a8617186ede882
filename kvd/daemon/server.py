"""The daemon: composition and dispatch, nothing else.

Two ZMQ ROUTER faces feed one dispatch table; every other job has one owner:

    registration, allocation, liveness, pool freeing   kvd.daemon.registry
    handshakes and the peer cache                      kvd.daemon.peers
    publish, acquire, notices, progress, leases        kvd.daemon.producer
    pulls                                              kvd.daemon.consumer
    completion events                                  kvd.daemon.events
    every NIXL call                                    kvd.daemon.datapath

The faces (kvd.daemon.faces) decode, authenticate and reply; here each message
type is mapped to its owner, and the daemon's lifecycle is composed: start,
housekeeping, drain on SIGTERM, stop with every resource released.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from kvd import __version__
from kvd.config import Config
from kvd.daemon.clock import Clock, MonotonicClock
from kvd.daemon.consumer import Consumer
from kvd.daemon.datapath import DataPath, new_nixl_executor
from kvd.daemon.events import EventHub
from kvd.daemon.faces import Face, Handler, Request
from kvd.daemon.peers import PeerTable
from kvd.daemon.producer import Producer
from kvd.daemon.registry import EngineRegistry
from kvd.daemon.services import Services
from kvd.errors import DrainingError, NotFoundError
from kvd.ops.metrics import Metrics
from kvd.planner import RankId
from kvd.transport.base import Transport
from kvd.wire import protocol as P

log = logging.getLogger("kvd.daemon")

HOUSEKEEPING_INTERVAL_S = 0.05  # leases, poll timeouts, engine liveness, pool freeing
DRAIN_POLL_S = 0.05
DRAIN_RELEASE_TIMEOUT_S = 0.4  # after drain_timeout_s: pulls failed, their READs released


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
        from kvd.ops.httpserver import start_http_server

        self.ctx = zmq.asyncio.Context()
        factory = self._transport_factory or self._nixl_factory
        # Creating the agent takes ~0.5 s: do it on the NIXL thread, like every NIXL call.
        executor = new_nixl_executor()
        transport = await asyncio.get_running_loop().run_in_executor(executor, factory)
        self.datapath = DataPath(transport, executor, self.clock)
        self.registry = EngineRegistry(self.cfg, self.clock, self.metrics, self.datapath,
                                       self.daemon_id, self.instance_id)
        self.registry.open()
        self.peers = PeerTable(self.ctx, self.cfg, self.clock, self.metrics, self.datapath,
                               self.token, self.daemon_id, self.instance_id)
        svc = Services(self.cfg, self.clock, self.metrics, self.datapath, self.registry,
                       self.peers, self.events, self.spawn, self.daemon_id, self.instance_id)
        self.producer, self.consumer = Producer(svc), Consumer(svc)
        cfg = self.cfg
        self.engine_face, self.peer_face = (
            Face(self.ctx, name, address, allowed, cfg.max_message_bytes,
                 cfg.receive_queue_bytes, self.token, self.instance_id, self.metrics)
            for name, address, allowed in (("engine", cfg.engine_address, P.ENGINE_REQUESTS),
                                           ("peer", cfg.peer_address, P.PEER_REQUESTS)))
        self.spawn(self.engine_face.serve(self._engine_handlers()))
        self.spawn(self.peer_face.serve(self._peer_handlers()))
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
                             progress_thread=self.cfg.nixl_progress_thread,
                             liveness_timeout_s=self.cfg.peer_liveness_timeout_s)

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
        self.registry.close()
        self.shutdown_counts = await self.datapath.counts()
        log.info("shutdown balance: registrations=%d transfers=%d (must be 0), peers=%d",
                 self.shutdown_counts.registrations, self.shutdown_counts.transfers,
                 self.shutdown_counts.peers)
        await self.datapath.close()
        self.peers.close()
        self.engine_face.close()
        self.peer_face.close()
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

    # ------------------------------------------------------------ dispatch

    def _reply_poll(self, identity: bytes, msg_id: int, events: P.Events) -> None:
        self.engine_face.send(identity, msg_id, events)

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise DrainingError(f"daemon is draining; not accepting new {what}")

    def _engine_handlers(self) -> dict[type, Handler]:
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

        async def publish(m: P.Publish, _: Request) -> P.Published:
            self._refuse_if_draining("publishes")
            return producer.publish(m)

        async def pull(m: P.Pull, req: Request) -> P.Ok | None:
            self._refuse_if_draining("pulls")
            if m.reply_when_done:  # answered by the consumer with the pull's event
                consumer.start(m, reply_to=(req.identity, req.header.id))
                return None
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

    def _peer_handlers(self) -> dict[type, Handler]:
        producer = self.producer

        async def hello(m: P.Hello, _: Request) -> P.HelloReply:
            return await producer.hello(m)

        async def acquire(m: P.Acquire, req: Request) -> P.Acquired:
            return producer.acquire(m, req.header.instance)

        async def heartbeat(m: P.Heartbeat, _: Request) -> P.HeartbeatAck:
            return producer.heartbeat(m)

        async def abandon(m: P.Abandon, _: Request) -> P.Ok:
            return producer.abandon(m)

        async def notice(m: P.ReadNotice, req: Request) -> P.Ok:
            producer.on_notice(m, req.header.instance or "peer")
            return P.Ok()

        return {P.Hello: hello, P.Acquire: acquire, P.Heartbeat: heartbeat, P.Abandon: abandon,
                P.ReadNotice: notice}

"""The daemon: composition and dispatch, nothing else.

Two ZMQ ROUTER faces feed one dispatch table; every other job has one owner:

    registration, allocation, liveness, pool freeing   kvd.daemon.engines.registry
    handshakes and the peer cache                      kvd.daemon.peers.table
    publish, acquire, notices, progress, leases        kvd.daemon.produce.producer
    pulls                                              kvd.daemon.pull
    completion events                                  kvd.daemon.events
    every NIXL call                                    kvd.daemon.datapath

The faces (kvd.daemon.faces) decode, authenticate and reply; here each message
type is mapped to its owner, and the daemon's lifecycle is composed: start,
housekeeping, drain on SIGTERM, stop with every resource released.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from kvd import __version__
from kvd.config import Config
from kvd.daemon.clock import Clock, MonotonicClock
from kvd.daemon.curve_auth import CurveGuard
from kvd.daemon.datapath import DataPath, new_nixl_executor
from kvd.daemon.engines.liveness import ConnectionTracker
from kvd.daemon.engines.registry import EngineRegistry
from kvd.daemon.events import AfterBurst, EventHub
from kvd.daemon.faces import Face, Handler, Request, is_loopback
from kvd.daemon.looplag import watch_loop_lag
from kvd.daemon.peers.table import PeerTable
from kvd.daemon.produce.local_peer import local_peer
from kvd.daemon.produce.producer import Producer
from kvd.daemon.pull.consumer import Consumer
from kvd.daemon.pull.warmup import warm_producers
from kvd.daemon.services import Services
from kvd.errors import ConfigError, DrainingError, NotFoundError
from kvd.ops.metrics import Metrics
from kvd.planner import RankId
from kvd.transport.base import Transport
from kvd.wire import curve as C
from kvd.wire import protocol as P
from kvd.wire.stream import direct_name

log = logging.getLogger("kvd.daemon")

HOUSEKEEPING_INTERVAL_S = 0.05  # leases, poll timeouts, engine liveness, pool freeing
DRAIN_POLL_S = 0.05
DRAIN_RELEASE_TIMEOUT_S = 0.4
# libzmq reports a closed connection just before it closes the descriptor: look after this.
CONNECTION_SETTLE_S = 0.05  # after drain_timeout_s: pulls failed, their READs released


def _spans(cfg: Config, metrics: Metrics, daemon_id: str, instance_id: str) -> Any:
    """OpenTelemetry spans when ``otel_traces`` is on (kvd.ops.otel); else None, and
    nothing of OpenTelemetry is imported."""
    if not cfg.otel_traces:
        return None
    try:
        from kvd.ops.otel import Spans
    except ImportError as exc:
        raise ConfigError(f"otel_traces=true needs OpenTelemetry: pip install 'kvd[otel]' "
                          f"({exc})") from exc
    return Spans(metrics, attributes={"kvd.daemon_id": daemon_id,
                                      "kvd.instance_id": instance_id,
                                      "kvd.peer_address": cfg.peer_advertise})


class Daemon:
    def __init__(self, cfg: Config, transport_factory: Callable[[], Transport] | None = None,
                 clock: Clock | None = None, metrics: Metrics | None = None,
                 token: str = "", curve_keys: C.KeyPair | None = None) -> None:
        self.cfg = cfg
        self.curve_keys = curve_keys  # this daemon's CURVE keypair (None: plaintext)
        self.curve: CurveGuard | None = None
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or Metrics()
        self.daemon_id = uuid.uuid4().hex[:12]
        self.instance_id = uuid.uuid4().hex  # this incarnation; never reused
        self.token = token
        self._transport_factory = transport_factory
        # events leave when the engine face has read its burst (bound to it at start)
        self.after_burst = AfterBurst(self.clock.now)
        self.events = EventHub(self._reply_poll, self.clock.now, self.metrics.events_dropped.inc,
                               schedule=self.after_burst.schedule,
                               instance_id=self.instance_id)
        self.draining = self.ready = self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = asyncio.Event()
        self.http = None
        self.spans: Any = None  # kvd.ops.otel.Spans when otel_traces is on

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind every socket first, then create the NIXL agent and claim the pool directory.

        A start that fails (a port in use, a missing ipc directory) raises one
        ``ConfigError`` naming the setting and leaves nothing behind: no owner lock in
        ``shm_dir``, no bound socket, no NIXL agent.
        """
        from kvd.ops.httpserver import start_http_server

        cfg = self.cfg
        self.spans = _spans(cfg, self.metrics, self.daemon_id, self.instance_id)
        self.ctx = zmq.asyncio.Context()
        self.engine_face = self.peer_face = None
        self.registry = self.datapath = None
        try:
            guard = None
            if self.curve_keys is not None:
                # ZAP answers before a CURVE face may accept anyone (fail closed).
                self.curve = guard = CurveGuard(cfg, self.curve_keys, self.metrics,
                                                on_revoked=self._curve_revoked,
                                                on_rekey=self._curve_rekeyed)
                guard.bind_zap(self.ctx)
            self.engine_face, self.peer_face = (
                _bind_face(self.ctx, name, setting, address, allowed, cfg, self.token,
                           self.instance_id, self.metrics, face_guard)
                for name, setting, address, allowed, face_guard in (
                    ("engine", "engine_address", cfg.engine_address, P.ENGINE_REQUESTS,
                     guard if curve_on_engine_face(cfg) else None),
                    ("peer", "peer_address", cfg.peer_address, P.PEER_REQUESTS, guard)))
            self._open_direct()
            if cfg.metrics_port:
                try:
                    self.http = start_http_server(cfg.metrics_host, cfg.metrics_port,
                                                  self.metrics.registry, self._ready)
                except OSError as exc:
                    raise ConfigError(
                        f"metrics_port={cfg.metrics_port} (metrics_host={cfg.metrics_host!r}): "
                        f"{exc.strerror or exc}") from exc
            factory = self._transport_factory or self._nixl_factory
            # Creating the agent takes ~0.5 s: do it on the NIXL thread, like every NIXL call.
            executor = new_nixl_executor()
            transport = await asyncio.get_running_loop().run_in_executor(executor, factory)
            self.datapath = DataPath(transport, executor, self.clock)
            self.registry = EngineRegistry(cfg, self.clock, self.metrics, self.datapath,
                                           self.daemon_id, self.instance_id)
            self.registry.open()
        except BaseException:
            await self._abort_start()
            raise
        self.peers = PeerTable(self.ctx, cfg, self.clock, self.metrics, self.datapath,
                               self.token, self.daemon_id, self.instance_id,
                               curve=self.curve)
        svc = Services(cfg, self.clock, self.metrics, self.datapath, self.registry,
                       self.peers, self.events, self.spawn, self.daemon_id, self.instance_id,
                       spans=self.spans)
        self.producer = Producer(svc)
        self.consumer = Consumer(svc, self._local_peer)
        self.after_burst.waiting = self.engine_face.waiting
        if cfg.copy_bursts:
            self.consumer.copy_bursts(self.engine_face.waiting)
        self.connections = ConnectionTracker()
        self.registry.on_engine_gone(self.connections.forget)
        engine_handlers = {t: self._noting(h) for t, h in self._engine_handlers().items()}
        self.spawn(self.engine_face.serve(engine_handlers))
        if self.engine_face.direct is not None:
            self.spawn(self.engine_face.direct.serve(engine_handlers))
        self.spawn(self.engine_face.watch_disconnects(
            lambda fd: self.spawn(self._retire_closed(fd))))
        self.spawn(self.peer_face.serve(self._peer_handlers()))
        if self.curve is not None:
            self.spawn(self.curve.serve_zap())
            self.spawn(self.curve.watch_allowlists(cfg.curve_reload_interval_s))
            self.spawn(self.peer_face.watch_disconnects(None))
            log.info("CURVE on: public key %s, peer face%s; allowlist %s (%d keys)",
                     self.curve_keys.public.decode(),  # the public key only, never the secret
                     " and engine face" if self.engine_face.curve else "",
                     cfg.curve_allowlist, len(self.curve.allowed["peer"]))
        self.spawn(self.producer.run_progress())
        self.spawn(self._housekeeping())
        self.spawn(watch_loop_lag(self.clock, self.metrics.loop_lag, self.metrics.loop_held))
        self.ready = True
        direct = self.engine_face.direct
        log.info("kvd %s serving: engine %s%s, peer %s (advertised %s), agent %s, instance %s",
                 __version__, cfg.engine_address,
                 f" (direct {direct.name})" if direct is not None else "", cfg.peer_address,
                 cfg.peer_advertise, self.datapath.agent_name, self.instance_id)

    async def _abort_start(self) -> None:
        """Undo a partial start, newest first, so a failed start leaves nothing behind."""
        if self.registry is not None:
            self.registry.close()
        if self.datapath is not None:
            await self.datapath.close()
        if self.http is not None:
            self.http.close()
            self.http = None
        self.ctx.destroy(linger=0)  # every socket, a face's whose bind failed included
        if self.spans is not None:
            self.spans.shutdown()  # its thread
            self.spans = None

    def _nixl_factory(self) -> Transport:
        from kvd.transport.remote import rails
        from kvd.transport.remote.nixl import NixlTransport

        def make(index: int, devices: str) -> Transport:
            suffix = f"-w{index}" if index else ""  # agent 0: the one peers know
            return NixlTransport(name=f"kvd-{self.daemon_id}{suffix}",
                                 backend=self.cfg.nixl_backend,
                                 progress_thread=self.cfg.nixl_progress_thread,
                                 liveness_timeout_s=self.cfg.peer_liveness_timeout_s,
                                 devices=devices)

        workers, rail_names = rails.resolve(self.cfg.posting_workers, self.cfg.rails)
        log.info("posting workers: %d; rails: %s", workers, ",".join(rail_names) or "none")
        return rails.build(make, workers, rail_names)

    def _curve_revoked(self, removed: frozenset[bytes]) -> None:
        """Keys removed from the allowlist: our own connections to their daemons go too."""
        if getattr(self, "peers", None) is not None:
            self.peers.revoke(removed)

    def _curve_rekeyed(self, keys: C.KeyPair) -> None:
        """New keypair: the CURVE faces serve new connections with it; our new outgoing
        connections present it (PeerTable reads the guard's keys per connection)."""
        for face in (self.engine_face, self.peer_face):
            if face is not None and face.curve is not None:
                self.spawn(self._rekey_face(face, keys))

    async def _rekey_face(self, face: Face, keys: C.KeyPair) -> None:
        try:
            await face.rekey(keys)
        except zmq.ZMQError as exc:
            log.error("re-binding the %s face (%s) with the new key failed: %s: it is not "
                      "listening; restart the daemon", face.name, face.address, exc)

    def _ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, "starting"
        return True, f"serving {self.registry.rank_count()} engine ranks"

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let held requests and pulls end within drain_timeout_s;
        then fail the pulls left (``draining``), release their READs, and stop."""
        self.draining = True
        log.info("draining: %d held, %d pulls", len(self.producer.held), len(self.consumer.pulls))
        deadline = self.clock.now() + self.cfg.drain_timeout_s
        while (self.producer.held.items or self.consumer.pulls) and self.clock.now() < deadline:
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
        self.consumer.close()  # local copies end before any pool is freed
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
        if self.curve is not None:
            self.curve.close()
        self.ctx.term()
        if self.http is not None:
            self.http.close()
        if self.spans is not None:
            self.spans.shutdown()  # the last spans exported
        log.info("kvd stopped")

    def _rails(self) -> list[P.RailStatus]:
        """Per posting worker counts (none with a single agent); syncs their metrics."""
        stats = getattr(self.datapath.transport, "stats", None) if self.datapath else None
        if not stats:
            return []
        out = [P.RailStatus(worker=i, rail=s.rail, agent=s.name, reads=s.reads,
                            nbytes=s.nbytes) for i, s in enumerate(stats)]
        self.metrics.rails_seen((r.worker, r.rail, r.reads, r.nbytes) for r in out)
        return out

    async def _housekeeping(self) -> None:
        while True:
            await self.clock.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                self._rails()
                now = self.clock.now()
                self.producer.expire(now)
                self.events.expire()
                self.registry.expire(now)
                await self.registry.collect()
                self.consumer.housekeeping()
                self.events.forget_except(set(self.registry.engines))
            except Exception:  # noqa: BLE001 - housekeeping must go on
                log.exception("housekeeping failed")

    def _open_direct(self) -> None:
        """The engine face's Unix door (kvd.daemon.direct), where it applies. A name
        another process holds (a second daemon bound to the same port on another
        address) leaves this daemon on ZMQ alone, said once."""
        cfg, face = self.cfg, self.engine_face
        name = direct_name(cfg.engine_address, serving=True)
        if not cfg.engine_direct or name is None or face.curve is not None:
            return
        try:
            face.open_direct(name, cfg.max_message_bytes, cfg.receive_queue_bytes)
        except OSError as exc:
            log.warning("engines reach this daemon over ZMQ only: the direct socket "
                        "%s is not free (%s)", name, exc.strerror or exc)

    # ------------------------------------------------------------ dispatch

    def _reply_poll(self, identity: bytes, msg_id: int, events: P.Events) -> None:
        self.engine_face.send(identity, msg_id, events)

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise DrainingError(f"daemon is draining; not accepting new {what}")

    def _noting(self, handler: Handler) -> Handler:
        """``handler``, then: the sender speaks for the message's (registered) engine."""

        async def noted(m: Any, req: Request) -> Any:
            result = await handler(m, req)
            engine_id = getattr(m, "engine_id", "")
            if engine_id in self.registry.engines and not isinstance(m, P.Deregister):
                self.connections.note(req.identity, req.fd, engine_id)
            return result

        return noted

    async def _retire_closed(self, fd: int) -> None:
        """An engine-face connection closed: retire the engines it leaves with none."""
        await self.clock.sleep(CONNECTION_SETTLE_S)
        for engine_id in self.connections.closed(fd):
            self.registry.retire_engine(engine_id, "gone: its connections to kvd closed")

    def _engine_handlers(self) -> dict[type, Handler]:
        reg, producer, consumer = self.registry, self.producer, self.consumer

        async def register(m: P.RegisterEngine, req: Request) -> None:
            self._refuse_if_draining("registrations (register with another kvd)")

            async def registered() -> P.Registered:
                reply = await reg.register(m)
                self.connections.note(req.identity, req.fd, m.engine_id)
                self.spawn(consumer.warm_local(m.engine_id))  # ahead of its first pulls
                return reply

            # Answered when done: a pool's allocation and NIXL registration take a
            # second or more per GiB, and the face answers every other engine meanwhile.
            self.spawn(self.engine_face.answer_later(req.identity, req.header.id,
                                                     registered()))

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

        async def seal(m: P.Seal, _: Request) -> P.Published:
            if not m.abort and (m.engine_id, m.request_id) not in producer.opened.items:
                self._refuse_if_draining("seals")  # a request already sealed goes on
            return producer.seal(m)

        async def cancel_pull(m: P.CancelPull, _: Request) -> P.Ok:
            consumer.cancel(m.engine_id, m.request_id)
            return P.Ok()

        async def poll(m: P.Poll, req: Request) -> None:
            if m.engine_id not in reg.engines:  # also after its last rank left: events remain
                raise NotFoundError(f"engine {m.engine_id!r} is not registered on this daemon")
            self.events.wait(m.engine_id, req.identity, req.header.id, m.timeout_s, m.max_events,
                             ack=m.ack, ack_instance=m.ack_instance)

        async def status(_: P.StatusQuery, __: Request) -> P.Status:
            rails = self._rails()
            pulls, finished = consumer.status()
            return P.Status(daemon_id=self.daemon_id, version=__version__,
                            draining=self.draining, engines=reg.status(),
                            peers=self.peers.status(), held=producer.status(),
                            pulls=pulls, instance_id=self.instance_id, rails=rails,
                            finished_pulls=finished)

        async def warm_up(m: P.WarmUp, _: Request) -> P.Ok:
            if m.producers:  # in the background: answered now (kvd.daemon.pull.warmup)
                self.spawn(warm_producers(consumer.warm_pair, self.clock, m.engine_id,
                                          list(m.producers)))
            return P.Ok()

        return {P.RegisterEngine: register, P.Deregister: deregister, P.Ping: ping,
                P.Publish: publish, P.Pull: pull, P.Poll: poll, P.StatusQuery: status,
                P.Seal: seal, P.CancelPull: cancel_pull, P.WarmUp: warm_up}

    def _local_peer(self, msg: object) -> object:
        """A local pull's peer message to this daemon's own producer side (kvd.daemon.
        produce.local_peer), for the incarnation of this daemon."""
        return local_peer(self.producer, msg, self.instance_id)

    def _peer_handlers(self) -> dict[type, Handler]:
        producer = self.producer

        async def hello(m: P.Hello, _: Request) -> P.HelloReply:
            return await producer.hello(m)

        async def acquire(m: P.Acquire, req: Request) -> P.Acquired | None:
            if not producer.acquire_must_wait(m):
                return producer.acquire(m, req.header.instance)
            # Before its Publish: answered when it comes (up to a second), while the face
            # answers everything else (heartbeats, notices, other Acquires) meanwhile.
            self.spawn(self.peer_face.answer_later(
                req.identity, req.header.id,
                producer.acquire_when_published(m, req.header.instance)))
            return None

        async def heartbeat(m: P.Heartbeat, _: Request) -> P.HeartbeatAck:
            return producer.heartbeat(m)

        async def abandon(m: P.Abandon, req: Request) -> P.Ok:
            return producer.abandon(m, req.header.instance)

        async def notice(m: P.ReadNotice, req: Request) -> P.Ok:
            producer.on_notice(m, req.header.instance or "peer")
            return P.Ok()

        async def watch(m: P.Watch, req: Request) -> None:
            # A long poll: answered at the first change, while the face serves the rest.
            self.spawn(self.peer_face.answer_later(req.identity, req.header.id,
                                                   producer.watch(m)))

        return {P.Hello: hello, P.Acquire: acquire, P.Heartbeat: heartbeat, P.Abandon: abandon,
                P.ReadNotice: notice, P.Watch: watch}


def _bind_face(ctx: zmq.asyncio.Context, name: str, setting: str, address: str,
               allowed: tuple[type, ...], cfg: Config, token: str, instance_id: str,
               metrics: Metrics, curve: CurveGuard | None = None) -> Face:
    """A bound face, or one ``ConfigError`` line naming the setting and why ZMQ refused."""
    try:
        return Face(ctx, name, address, allowed, cfg.max_message_bytes, cfg.receive_queue_bytes,
                    token, instance_id, metrics, curve)
    except zmq.ZMQError as exc:
        raise ConfigError(f"{setting}={address!r}: {bind_failure(address, exc)}") from exc


def curve_on_engine_face(cfg: Config) -> bool:
    """CURVE on the engine face: asked for, and bound off loopback (loopback and ipc://
    stay as they are: the token, or nothing)."""
    return bool(cfg.curve_secret_key_file and cfg.curve_engine_face
                and not is_loopback(cfg.engine_address))


def bind_failure(address: str, exc: zmq.ZMQError) -> str:
    """ZMQ's reason for a failed bind, with what to do about the usual ones."""
    if exc.errno == zmq.EADDRINUSE:
        return "address already in use (another kvd? give each daemon its own ports)"
    if address.startswith("ipc://") and exc.errno == errno.ENOENT:
        return f"directory {os.path.dirname(address[len('ipc://'):])!r} does not exist"
    return str(exc)

"""Handshakes with other kvd daemons and what they teach us, cached until proven stale.

The consumer greets the producer daemon a pull names (and every daemon in its
``engine_daemons``) once per (local engine, remote engine): the remote engine's
geometry, which daemon hosts each rank at which pool address, each daemon's NIXL
agent and its incarnation (``instance``). The cache entry is dropped, and the
next pull handshakes again, when:

* a reply from one of its daemons carries another instance (the daemon restarted);
* ZMQ reports the connection to one of its daemons dropped;
* a READ from one of its daemons failed, or a request to it timed out
  (``drop_address``, called by the consumer);
* a pull names an address the entry does not contain;
* an Acquire reports another epoch (pools came or went there; ``forget``).

Handshakes dropped because the connection dropped (liveness: a partition, a frozen
peer, or a stall of this daemon's own longer than ``peer_liveness_timeout_s``) are
made again when ZMQ's redial connects (``on_regained``, the consumer's warm-up): the
next pull finds them fresh and warm, instead of greeting, loading NIXL metadata and
mapping pool files on its own path.

A handshake to a daemon whose connection is down (liveness lost it, or it closed and
ZMQ's redials have not brought it back) fails ``peer_lost`` at once rather than after
``handshake_timeout_s``; one restarted at the same address is greeted as soon as the
redial connects.

Dropping a daemon also drops its NIXL metadata (once no READ to it is in flight),
so a restarted daemon is loaded afresh rather than through stale sections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

from kvd.config import Config
from kvd.daemon.clock import Clock
from kvd.daemon.curve_auth import CurveGuard
from kvd.daemon.datapath import DataPath
from kvd.daemon.engines.table import Engine
from kvd.daemon.peers.conn import LOST, PeerConnection, Reply
from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine, RemoteRank
from kvd.errors import (
    AuthError,
    IncompatibleError,
    KvdError,
    KvdTimeoutError,
    PeerLostError,
    ProtocolError,
)
from kvd.ops.metrics import Metrics
from kvd.planner import RankId
from kvd.wire import protocol as P

log = logging.getLogger("kvd.peers")

_REFUSED = ("incompatible", "not_found", "unauthorized")
# How long a handshake to a daemon known unreachable waits for ZMQ's redial (every
# RECONNECT_INTERVAL_MS) before it fails peer_lost, instead of handshake_timeout_s.
KNOWN_DEAD_WAIT_S = 0.3
MAX_LOST_PAIRS = 4096  # pairs remembered for a re-warm, all addresses together


class PeerTable:
    """Connections to remote daemons and the cached handshakes."""

    def __init__(self, ctx: zmq.asyncio.Context, cfg: Config, clock: Clock, metrics: Metrics,
                 datapath: DataPath, token: str, daemon_id: str, instance_id: str,
                 curve: CurveGuard | None = None) -> None:
        self.ctx = ctx
        self.curve = curve
        self.server_keys: dict[str, bytes] = {}  # peer address -> its CURVE key (learnt)
        self.cfg = cfg
        self.clock = clock
        self.metrics = metrics
        self.datapath = datapath
        self.token = token
        self.daemon_id = daemon_id
        self.instance_id = instance_id
        self.conns: dict[str, PeerConnection] = {}
        self.remotes: dict[tuple[str, str], RemoteEngine] = {}
        self._inflight: dict[tuple[str, str], asyncio.Task[RemoteEngine]] = {}
        self._closed = False
        # Per daemon address, the handshakes its connection's drop took: (local engine,
        # remote engine, the address greeted), handed to ``on_regained`` when it is back.
        self._lost_pairs: dict[str, set[tuple[str, str, str]]] = {}
        self.on_regained: Callable[[list[tuple[str, str, str]]], None] | None = None

    # ------------------------------------------------------------ connections

    def conn(self, address: str) -> PeerConnection:
        if self._closed:
            raise KvdError("daemon is stopping: no new peer requests")
        if not address.startswith("tcp://"):
            raise KvdError(f"remote address {address!r} must be a tcp:// peer endpoint")
        c = self.conns.get(address)
        if c is None:
            curve = self.curve
            c = self.conns[address] = PeerConnection(
                self.ctx, address, self.token, self.instance_id, self.cfg.max_message_bytes,
                self.clock, self.drop_address, self.cfg.peer_liveness_timeout_s,
                curve_keys=curve.keys if curve else None,
                server_key=self.server_keys.get(address),
                candidates=(lambda: _candidates(curve)) if curve else None,
                on_key=self.server_keys.__setitem__, on_refused=self._refused,
                discover_timeout_s=self.cfg.handshake_timeout_s, on_up=self._up)
        return c

    def _up(self, address: str) -> None:
        """``address``'s connection is back after a drop: the pairs it took, warmed again."""
        pairs = self._lost_pairs.pop(address, None)
        if pairs and self.on_regained is not None and not self._closed:
            self.on_regained(sorted(pairs))

    def _refused(self, address: str) -> None:
        """The security handshake with ``address`` failed: a CURVE connection is dropped
        (its requests already failed) so that the next request looks for the server's
        key again (it may have rotated it); a plaintext one stays, failing requests at
        once until a redial succeeds."""
        if self.curve is None:
            return
        self.server_keys.pop(address, None)
        c = self.conns.get(address)
        if c is not None:
            del self.conns[address]
            asyncio.get_running_loop().call_soon(c.close)
            self.drop_address(address, "CURVE handshake refused")

    def revoke(self, removed: frozenset[bytes]) -> None:
        """Keys removed from the allowlist: close our connections to daemons holding them."""
        for address, key in list(self.server_keys.items()):
            if key not in removed:
                continue
            del self.server_keys[address]
            c = self.conns.pop(address, None)
            if c is not None:
                c.close()
            log.warning("closed the connection to %s: its key was removed from the "
                        "allowlist", address, extra={"peer": address})
            self.drop_address(address, "key revoked")

    async def request(self, address: str, msg: object, timeout_s: float | None = None) -> Reply:
        """One request to a daemon; no answer drops what we cached about it. With CURVE,
        a refusal on a connection made with a cached server key is retried once with
        the key looked up afresh (the peer may have rotated its keypair)."""
        cached = self.curve is not None and address in self.server_keys
        try:
            return await self.send(address, msg, timeout_s)
        except AuthError:
            if not cached:
                raise
            self._refused(address)
            return await self.send(address, msg, timeout_s)

    def send(self, address: str, msg: object, timeout_s: float | None = None
             ) -> asyncio.Future[Reply]:
        """The same request, on the wire before this returns: its reply (or error) is
        the returned future, so the caller can work meanwhile (a pull posts its READs
        while its Acquire travels: one round trip off a small pull's path)."""
        try:
            conn = self.conn(address)
        except KvdError as exc:
            fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
            return fut
        fut = conn.send(msg, self.cfg.handshake_timeout_s if timeout_s is None else timeout_s)

        def answered(f: asyncio.Future[Reply]) -> None:
            # Retrieved here, so that a reply nobody awaits any more (its pull was
            # cancelled) is not logged as a lost exception; awaiting it still raises.
            exc = None if f.cancelled() else f.exception()
            if isinstance(exc, (KvdTimeoutError, PeerLostError)):
                self.drop_address(address, "no answer")

        fut.add_done_callback(answered)
        return fut

    def take_ready(self, addresses: Iterable[str]) -> None:
        """Handle the replies queued on these daemons' connections (`PeerConnection.take_ready`)."""
        for address in addresses:
            conn = self.conns.get(address)
            if conn is not None:
                conn.take_ready()

    def drop_address(self, address: str, why: str) -> None:
        """Forget every cached handshake involving that daemon, and its NIXL metadata."""
        agents = set()
        for key, remote in list(self.remotes.items()):
            if address in remote.daemons:
                agents.add(remote.daemons[address].agent)
                del self.remotes[key]
                if why == LOST and remote.via:  # warmed again once it is back
                    if sum(map(len, self._lost_pairs.values())) >= MAX_LOST_PAIRS:
                        self._lost_pairs.clear()  # peers that never came back: forgotten
                    self._lost_pairs.setdefault(address, set()).add((*key, remote.via))
        if agents:
            log.info("dropped cached handshakes with %s (%s)", address, why,
                     extra={"peer": address})
            self._count_peers()
        still_used = {d.agent for r in self.remotes.values() for d in r.daemons.values()}
        for agent in agents - still_used:
            asyncio.get_running_loop().create_task(self.datapath.forget_peer(agent))

    def forget(self, local_engine: str, remote_engine: str) -> None:
        self.remotes.pop((local_engine, remote_engine), None)

    # ------------------------------------------------------------ handshakes

    def cached(self, engine_id: str, remote_engine: str, address: str) -> RemoteEngine | None:
        """The cached handshake that `remote_engine` would return at once, if any."""
        cached = self.remotes.get((engine_id, remote_engine))
        return cached if cached is not None and address in cached.daemons else None

    async def remote_engine(self, engine: Engine, remote_engine: str,
                            address: str) -> RemoteEngine:
        """The cached handshake for (engine, remote engine) through ``address``.

        Single flight: pulls arriving while a handshake for the same pair runs wait for
        that one and share its outcome (a dead peer fails them all after one timeout),
        and only that one is counted in the metrics.
        """
        key = (engine.engine_id, remote_engine)
        cached = self.remotes.get(key)
        if cached is not None:
            if address in cached.daemons:
                return cached
            log.info("pull names %s, not a daemon of the cached handshake %s: handshaking",
                     address, sorted(cached.daemons), extra={"peer": address})
            del self.remotes[key]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._counted_handshake(key, engine, remote_engine, address))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._handshake_done(key, t))
        # shield: one pull being cancelled must not cancel the handshake others wait for.
        return await asyncio.shield(task)

    def _handshake_done(self, key: tuple[str, str], task: asyncio.Task[RemoteEngine]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: waiters re-raise it themselves

    async def _counted_handshake(self, key: tuple[str, str], engine: Engine,
                                 remote_engine: str, address: str) -> RemoteEngine:
        start = time.perf_counter()
        try:
            remote = await self._handshake(engine, remote_engine, address)
        except KvdTimeoutError:
            self.metrics.handshakes.labels(outcome="timeout").inc()
            raise
        except KvdError as exc:
            outcome = "refused" if exc.code in _REFUSED else "failed"
            self.metrics.handshakes.labels(outcome=outcome).inc()
            raise
        self.metrics.handshakes.labels(outcome="ok").inc()
        self.metrics.handshake_duration.observe(time.perf_counter() - start)
        remote.via = address
        self.remotes[key] = remote
        self._count_peers()
        return remote

    def _count_peers(self) -> None:
        self.metrics.peers.set(len({a for r in self.remotes.values() for a in r.daemons}))

    async def _handshake(self, engine: Engine, remote_engine: str, address: str
                         ) -> RemoteEngine:
        hello = P.Hello(daemon_id=self.daemon_id, remote_engine_id=remote_engine,
                        consumer=engine.desc(), agent_metadata=b"", compat_hash=engine.compat)
        todo, seen = [address], set()
        remote: RemoteEngine | None = None
        while todo:
            addr = todo.pop(0)
            if addr in seen:
                continue
            seen.add(addr)
            await self._check_reachable(addr)
            reply = await self.request(addr, hello)
            body = reply.body
            if not isinstance(body, P.HelloReply):
                raise ProtocolError(f"peer {addr} answered Hello with {type(body).__name__}")
            if body.engine.engine_id != remote_engine:
                raise IncompatibleError(f"peer {addr} answered for engine "
                                        f"{body.engine.engine_id!r}, not {remote_engine!r}")
            agent = await self.datapath.load_peer(body.agent_metadata, body.agent_name)
            if remote is None:
                remote = RemoteEngine(desc=body.engine)
            elif _geometry(remote.desc) != _geometry(body.engine):
                raise IncompatibleError(f"daemons disagree on engine {remote_engine!r} geometry")
            remote.daemons[addr] = RemoteDaemon(addr, agent, reply.instance, body.engine.epoch,
                                                body.host_token)
            files = (body.pool_files if len(body.pool_files) == len(body.engine.ranks)
                     else [P.PoolFile()] * len(body.engine.ranks))
            for r, f in zip(body.engine.ranks, files, strict=True):
                rid = RankId(r.tp_rank, r.pp_rank)
                remote.ranks.setdefault(rid, RemoteRank(rid, addr, agent, r, f))
            todo.extend(a for a in body.engine_daemons if a not in seen)
        assert remote is not None
        want = {RankId(t, p) for t in range(remote.desc.tp_size)
                for p in range(remote.desc.pp_size)}
        missing = sorted(want - set(remote.ranks))
        if missing:
            raise KvdError(
                f"engine {remote_engine!r}: ranks {[m.key for m in missing][:8]} are not hosted by "
                f"any daemon reached ({sorted(seen)}); register them or list their daemons in "
                "engine_daemons"
            )
        return remote

    async def _check_reachable(self, address: str) -> None:
        """Fail at once (``peer_lost``) while ``address`` is known unreachable: our
        connection to it dropped (liveness lost it, or it closed) and ZMQ's redials have
        not brought it back. Waiting the whole handshake_timeout_s would only delay the
        engine's recompute. The wait here is short but covers a daemon restarted at the
        same address: ZMQ redials every RECONNECT_INTERVAL_MS, so one listening again is
        greeted (its new incarnation is in the reply) as soon as it is back."""
        conn = self.conns.get(address)
        if conn is None or conn.connected is not False:
            return
        if await conn.reconnected(min(KNOWN_DEAD_WAIT_S, self.cfg.handshake_timeout_s)):
            return
        if self.curve is not None and (conn.refused is not None
                                       or address in self.server_keys):
            # Its redials may be failing the CURVE handshake (the peer rotated its
            # keypair, and rebinding dropped our connection): look its key up afresh;
            # a daemon really gone fails that within the liveness timeout.
            self._refused(address)
            return
        lost_s = self.clock.now() - (conn.lost_s or self.clock.now())
        raise PeerLostError(f"peer {address} is unreachable: its connection dropped "
                            f"{lost_s:.1f}s ago and has not come back")

    def status(self) -> list[P.PeerStatus]:
        return [P.PeerStatus(address=addr, local_engine=k[0], remote_engine=k[1], agent=d.agent,
                             instance=d.instance, path=getattr(remote.route, "path", ""),
                             why=getattr(remote.route, "why", ""))
                for k, remote in self.remotes.items() for addr, d in remote.daemons.items()]

    def close(self) -> None:
        self._closed = True
        for t in self._inflight.values():
            t.cancel()
        for c in self.conns.values():
            c.close()
        self.conns.clear()


def _candidates(curve: CurveGuard) -> list[bytes]:
    """The keys a new peer may hold: the allowlist but this daemon's own key (a peer
    sharing it, one keypair per tier, is tried only when no other key fits: every
    wrong guess costs the server a refused handshake)."""
    return sorted(curve.allowed["peer"] - {curve.keys.public})


def _geometry(d: P.EngineDesc) -> tuple:
    return (d.model, d.layout.kv_layout, d.layout.head_layout, d.layout.block_size_tokens,
            d.tp_size, d.pp_size, d.layer_partition)

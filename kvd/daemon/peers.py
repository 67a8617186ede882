"""Talking to other kvd daemons: request/reply over DEALER, and the handshake cache.

One DEALER socket per remote daemon address; replies are matched to requests
by header id, and every wait is bounded. The handshake result for a (local
engine, remote engine) pair is computed once and cached: the remote engine's
geometry, which daemon hosts each of its ranks, and each daemon's NIXL agent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvd import protocol as P
from kvd.errors import (
    IncompatibleError,
    KvdError,
    KvdTimeoutError,
    ProtocolError,
    error_from_code,
)
from kvd.planner import RankId

log = logging.getLogger("kvd.peers")


class PeerConnection:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, token: str,
                 max_message_bytes: int) -> None:
        self.address = address
        self.token = token
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.connect(address)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                header, body = P.decode(frames, P.REPLIES)
            except ProtocolError as exc:
                log.warning("undecodable reply from %s: %s", self.address, exc)
                continue
            fut = self._waiting.pop(header.id, None)
            if fut is not None and not fut.done():
                fut.set_result(body)

    async def request(self, msg: Any, timeout_s: float) -> Any:
        msg_id = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = fut
        try:
            await self.sock.send_multipart(P.encode(msg, msg_id, self.token))
            reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise KvdTimeoutError(
                f"peer {self.address} did not answer {type(msg).__name__} within {timeout_s}s"
            ) from None
        finally:
            self._waiting.pop(msg_id, None)
        if isinstance(reply, P.Error):
            raise error_from_code(reply.code, f"peer {self.address}: {reply.message}")
        return reply

    def close(self) -> None:
        self._reader.cancel()
        self.sock.close(0)


@dataclass
class RemoteRank:
    rank: RankId
    daemon: str  # peer address
    agent: str  # NIXL agent name
    desc: P.RankDesc


@dataclass
class RemoteEngine:
    """A remote engine as learned by handshakes with every daemon hosting its ranks."""

    desc: P.EngineDesc  # geometry (ranks field: as reported by the first daemon)
    ranks: dict[RankId, RemoteRank]
    daemons: dict[str, str]  # peer address -> agent name
    epochs: dict[str, int] = field(default_factory=dict)  # peer address -> engine epoch


class PeerTable:
    """Connections to remote daemons and the cached handshakes."""

    def __init__(self, ctx: zmq.asyncio.Context, token: str, max_message_bytes: int,
                 timeout_s: float) -> None:
        self.ctx = ctx
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.conns: dict[str, PeerConnection] = {}
        self.remotes: dict[tuple[str, str], RemoteEngine] = {}
        self._inflight: dict[tuple[str, str], asyncio.Task] = {}

    def conn(self, address: str) -> PeerConnection:
        if not address.startswith("tcp://"):
            raise KvdError(f"remote address {address!r} must be a tcp:// peer endpoint")
        c = self.conns.get(address)
        if c is None:
            c = self.conns[address] = PeerConnection(self.ctx, address, self.token,
                                                     self.max_message_bytes)
        return c

    def drop(self, address: str) -> None:
        c = self.conns.pop(address, None)
        if c is not None:
            c.close()
        for key, remote in list(self.remotes.items()):
            if address in remote.daemons:
                del self.remotes[key]

    def forget(self, local_engine: str, remote_engine: str) -> None:
        self.remotes.pop((local_engine, remote_engine), None)

    async def remote_engine(
        self,
        local_engine: str,
        remote_engine: str,
        address: str,
        hello: Callable[[], Awaitable[P.Hello]],
        load_agent: Callable[[bytes, str], Awaitable[str]],
    ) -> tuple[RemoteEngine, bool]:
        """Cached handshake; returns (remote engine, True if it was a cache hit).

        Single flight: pulls arriving while a handshake for the same pair runs wait for that
        one and share its outcome, so a dead peer fails them all after one timeout (not one
        timeout each, in turn). They count as cache hits; a failure is raised to each of them
        as the same exception object.
        """
        key = (local_engine, remote_engine)
        if key in self.remotes:
            return self.remotes[key], True
        task = self._inflight.get(key)
        leader = task is None
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._handshake_and_cache(key, remote_engine, address, hello, load_agent))
            self._inflight[key] = task
            task.add_done_callback(lambda t: (self._inflight.pop(key, None)
                                              if self._inflight.get(key) is t else None,
                                              t.cancelled() or t.exception()))
        # shield: one pull being cancelled must not cancel the handshake others wait for.
        return await asyncio.shield(task), not leader

    async def _handshake_and_cache(self, key: tuple[str, str], remote_engine: str,
                                   address: str, hello: Callable[[], Awaitable[P.Hello]],
                                   load_agent: Callable[[bytes, str], Awaitable[str]]
                                   ) -> RemoteEngine:
        remote = await self._handshake(remote_engine, address, hello, load_agent)
        self.remotes[key] = remote
        return remote

    async def _handshake(self, remote_engine: str, address: str,
                         hello: Callable[[], Awaitable[P.Hello]],
                         load_agent: Callable[[bytes, str], Awaitable[str]]) -> RemoteEngine:
        todo = [address]
        seen: set[str] = set()
        remote: RemoteEngine | None = None
        while todo:
            addr = todo.pop(0)
            if addr in seen:
                continue
            seen.add(addr)
            reply = await self.conn(addr).request(await hello(), self.timeout_s)
            if not isinstance(reply, P.HelloReply):
                raise ProtocolError(f"peer {addr} answered Hello with {type(reply).__name__}")
            if reply.engine.engine_id != remote_engine:
                raise IncompatibleError(f"peer {addr} answered for engine "
                                        f"{reply.engine.engine_id!r}, not {remote_engine!r}")
            agent = await load_agent(reply.agent_metadata, reply.agent_name)
            if remote is None:
                remote = RemoteEngine(desc=reply.engine, ranks={}, daemons={})
            elif _geometry(remote.desc) != _geometry(reply.engine):
                raise IncompatibleError(f"daemons disagree on engine {remote_engine!r} geometry")
            remote.daemons[addr] = agent
            remote.epochs[addr] = reply.engine.epoch
            for r in reply.engine.ranks:
                rid = RankId(r.tp_rank, r.pp_rank)
                remote.ranks.setdefault(rid, RemoteRank(rid, addr, agent, r))
            todo.extend(a for a in reply.engine_daemons if a not in seen)
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

    def close(self) -> None:
        for t in self._inflight.values():
            t.cancel()
        for c in self.conns.values():
            c.close()
        self.conns.clear()


def _geometry(d: P.EngineDesc) -> tuple:
    return (d.model, d.layout.kv_layout, d.layout.head_layout, d.layout.block_size_tokens,
            d.tp_size, d.pp_size, d.layer_partition)

"""The control network between simulated daemons, and `FakePeers`: kvd's peer table
(kvd.daemon.peers.table) over it, for the real `PullDriver`.

Requests and replies with delays; partitions; dropped, delayed, duplicated and
reordered messages (in order on one connection unless ``Knobs.fifo`` is off); every
request has a timeout; liveness notices a silent peer after ``peer_liveness_timeout_s``
(`Daemon.on_lost`), and a dead one at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.errors import KvdError, KvdTimeoutError, PeerLostError
from kvd.wire import protocol as P

if TYPE_CHECKING:
    from support.fleet.daemon import Daemon
    from support.fleet.fakes import FakeEngine
    from support.fleet.sim import Sim

KNOWN_DEAD_WAIT_S = 0.3  # kvd.daemon.peers.table: a handshake to a daemon known lost
DRAM = SimpleNamespace(mem_type="DRAM")  # the remote engine's description, as assembled


@dataclass(eq=False)
class Request:
    rid: int
    src: Daemon
    dst: Daemon
    msg: Any
    then: Callable[[Reply | KvdError], None]
    instance: str  # the sender's incarnation (the header's instance)
    dst_instance: str = ""


class Network:
    """Control messages between daemons: delays, partitions and the faults of ``msg``
    windows; every request has a timeout; liveness notices silent peers."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.ids = itertools.count(1)
        self.last: dict[tuple[str, str], float] = {}  # the last delivery per connection

    def _delay(self, a: int, b: int) -> list[float]:
        """Delivery delays of one message from a to b ([]: dropped, two: duplicated)."""
        rng = self.sim.net_rng
        base = rng.uniform(0.0001, 0.001)
        kind = self.sim.msg_fault(a, b)
        if kind is None or rng.random() < 1.0 - self.sim.knobs.msg_fault_p:
            return [base]
        if kind == "drop":
            return []
        if kind == "delay":
            return [base + rng.uniform(0.05, 1.5)]
        if kind == "dup":
            return [base, base + rng.uniform(0.0, 0.3)]
        return [base + rng.uniform(0.0, 0.05)]  # reorder: later ones may overtake it (not fifo)

    def request(self, src: Daemon, addr: str, msg: Any, timeout_s: float,
                then: Callable[[Reply | KvdError], None]) -> None:
        dst = self.sim.by_addr[addr]
        req = Request(next(self.ids), src, dst, msg, then, src.instance, dst.instance)
        src.pending[req.rid] = req
        src.after(timeout_s, self._timeout, src, req)
        for delay in self._delay(src.index, dst.index):
            self._carry(src.index, dst.index, delay, self._arrive, dst, dst.inc, req)

    def _carry(self, a: int, b: int, delay: float, fn: Callable[..., None], *args: Any) -> None:
        """Deliver after ``delay``; across a partition, once it heals (TCP retransmits),
        unless liveness gave the connection up meanwhile (ZMQ then drops its queue)."""
        sim = self.sim
        sent_s = sim.now
        if sim.knobs.fifo:  # one connection per incarnation pair: TCP keeps its order
            key = (sim.daemons[a].instance, sim.daemons[b].instance)
            at = max(sim.now + delay, self.last.get(key, 0.0) + 1e-6)
            self.last[key] = at
            delay = at - sim.now

        def hop() -> None:
            heal = sim.partition_heals(a, b)
            if heal is not None:
                sim.at(heal + 0.001, hop)
                return
            if sim.now - sent_s >= sim.cfg.peer_liveness_timeout_s and sim.was_partitioned(
                    a, b, sent_s):
                return
            fn(*args)

        sim.after(delay, hop)

    def _arrive(self, dst: Daemon, inc: int, req: Request) -> None:
        if not dst.up or dst.inc != inc:  # its connection died with it
            return
        dst.after(0.0, dst.on_request, req.src, req)

    def send_reply(self, dst: Daemon, src: Daemon, req: Request, body: Any) -> None:
        inc = src.inc
        instance = dst.instance
        for delay in self._delay(dst.index, src.index):
            self._carry(dst.index, src.index, delay, self._answer, src, inc, req, body,
                        instance)

    def _answer(self, src: Daemon, inc: int, req: Request, body: Any, instance: str) -> None:
        if src.inc != inc or not src.up or instance in src.dead_seen:
            return
        src.after(0.0, self._answered, src, req, body, instance)

    def _answered(self, src: Daemon, req: Request, body: Any, instance: str) -> None:
        if self.sim.trace is not None:
            self.sim.note(f"{src.instance} <- {instance} {type(req.msg).__name__} reply "
                          f"{type(body).__name__}")
        if src.pending.pop(req.rid, None) is None:
            return  # timed out, lost, or a duplicate
        if isinstance(body, KvdError):
            req.then(body)
        else:
            req.then(Reply(body, instance, self.sim.now))

    def _timeout(self, src: Daemon, req: Request) -> None:
        if src.pending.pop(req.rid, None) is None:
            return
        src.drop_address(req.dst.addr)  # no answer: what we cached about it goes
        req.then(KvdTimeoutError(f"no answer from {req.dst.addr}"))


class FakeConn:
    """A control connection as the driver sees it: ``connected`` is False once liveness
    lost it."""

    __slots__ = ("daemon", "index")

    def __init__(self, daemon: Daemon, index: int) -> None:
        self.daemon, self.index = daemon, index

    @property
    def connected(self) -> bool:
        return self.index not in self.daemon.lost


class FakeConns:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._conns: dict[str, FakeConn] = {}

    def get(self, address: str, default: Any = None) -> FakeConn | None:
        conn = self._conns.get(address)
        if conn is None:
            other = self.daemon.sim.by_addr.get(address)
            if other is None:
                return default
            conn = self._conns[address] = FakeConn(self.daemon, other.index)
        return conn


class FakePeers:
    """kvd.daemon.peers.table.PeerTable of one daemon over the simulated network: each
    send a future the network resolves (through the daemon: not while it is frozen);
    the handshakes it caches in ``Daemon.remotes``."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.conns = FakeConns(daemon)

    def send(self, address: str, msg: object, timeout_s: float | None = None
             ) -> asyncio.Future[Reply]:
        fut: asyncio.Future[Reply] = self.daemon.sim.loop.create_future()

        def then(r: Reply | KvdError) -> None:
            if fut.done():
                return
            if isinstance(r, KvdError):
                fut.set_exception(r)
            else:
                fut.set_result(r)

        self.daemon.request(address, msg, timeout_s, then)
        return fut

    async def request(self, address: str, msg: object, timeout_s: float | None = None
                      ) -> Reply:
        return await self.send(address, msg, timeout_s)

    def take_ready(self, addresses: object) -> None:
        pass  # replies arrive as the network delivers them

    def drop_address(self, address: str, why: str) -> None:
        self.daemon.drop_address(address)

    def forget(self, local_engine: str, remote_engine: str) -> None:
        self.daemon.remotes.pop((local_engine, remote_engine), None)

    def cached(self, engine_id: str, remote_engine: str, address: str) -> RemoteEngine | None:
        remote = self.daemon.remotes.get((engine_id, remote_engine))
        return remote if remote is not None and address in remote.daemons else None

    async def remote_engine(self, engine: FakeEngine, remote_engine: str, address: str
                            ) -> RemoteEngine:
        """The cached handshake, else a Hello (a daemon known lost: fails after a wait)."""
        d = self.daemon
        key = (engine.engine_id, remote_engine)
        cached = self.cached(*key, address)
        if cached is not None:
            return cached
        d.remotes.pop(key, None)
        if d.unreachable([address]):
            await d.svc.clock.sleep(KNOWN_DEAD_WAIT_S)
            raise PeerLostError(f"{address} is unreachable")
        hello = P.Hello(daemon_id=d.name, remote_engine_id=remote_engine,
                        consumer=None, agent_metadata=b"", compat_hash="")  # type: ignore[arg-type]
        r = await self.request(address, hello)
        _, agent, epoch, pool_uid = r.body
        remote = RemoteEngine(desc=DRAM, daemons={  # type: ignore[arg-type]
            address: RemoteDaemon(address, agent=agent, instance=r.instance, epoch=epoch)},
            pools=pool_uid)
        d.remotes[key] = remote
        return remote

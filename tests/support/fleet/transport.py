"""The simulated transport, and what kvd's real `PullDriver` sees of it: `FakeMover` (a
pull's READs or host copies), `FakeHostMaps` (the producer's mapped pool files) and the
assembly of a pull's descriptors.

A READ copies bytes between numpy pools descriptor by descriptor, each write recorded
with its time and checked (never after its pull was reported, never into a freed pool,
never into blocks the engine got back). An address is a registration's uid times
``POOL_SPAN`` plus a block: the pool it names, as a real address does.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.pull import machine as M
from kvd.daemon.pull.state import Path
from kvd.errors import KvdError, TransferError
from kvd.planner.assembly import ProducerReads
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from support.fleet import layouts
from support.fleet.fakes import POOL_SPAN, FakeEngine

if TYPE_CHECKING:
    from support.fleet.daemon import Daemon, PullRec
    from support.fleet.sim import Sim


class Xfer:
    """One READ: descriptors copied one by one from a producer pool into a consumer pool."""

    def __init__(self, xid: int, consumer: Daemon, agent: str, src: FakeEngine | None,
                 dst: FakeEngine,
                 pairs: list[tuple[int, int]], pull: PullRec, mode: str,
                 host: bool = False) -> None:
        self.id = xid
        self.consumer = consumer
        self.consumer_inc = consumer.inc
        self.agent = agent
        self.src = src
        self.dst = dst
        self.pairs = pairs
        self.pull = pull
        self.mode = mode  # ok, stall, fail, late
        self.state = XferState.PENDING
        self.error: TransferError | None = None
        self.released = False
        self.next = 0
        self.hold_key = pull.hold_key
        self.host = host  # a copy from mapped pool files: no agent, no failure of its own


class Transport:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.xfers: dict[int, Xfer] = {}
        self.ids = itertools.count(1)
        self.writes: list[tuple[float, str, str, int, str]] = []  # t, daemon, engine, block, pull

    def post(self, d: Daemon, posts: list[ReadPost], rec: PullRec, host: bool = False
             ) -> list[PostResult]:
        sim = self.sim
        out = []
        for post in posts:
            owner = sim.agents.get(post.peer)
            # the remote addresses name the pool (its registration) and the block in it
            src = sim.regs.get(int(post.remote_addrs[0]) // POOL_SPAN)
            dst = sim.regs[int(post.local_addrs[0]) // POOL_SPAN]  # the pool it writes
            if owner is None or (not host and (not owner.up or owner.agent != post.peer)):
                out.append(PostResult(None, False, TransferError(
                    f"nixl: unknown or dead remote agent {post.peer}")))
                continue
            mode = sim.read_mode(d)
            # (remote, local) blocks, or byte offsets with engine_block_tokens; and sizes
            pairs = [(int(r) % POOL_SPAN, int(loc) % POOL_SPAN, int(n))
                     for r, loc, n in zip(post.remote_addrs, post.local_addrs, post.nbytes,
                                          strict=True)]
            x = Xfer(next(self.ids), d, post.peer, src, dst, pairs, rec, mode, host)
            x.hold_key = (owner.instance, rec.producer_engine, rec.remote_rid)
            self.xfers[x.id] = x
            d.xfers.add(x.id)
            sim.after(sim.net_rng.uniform(0.0001, 0.002), self._step, x)
            out.append(PostResult(x.id, False))
        return out

    def _fail(self, x: Xfer, why: str) -> None:
        if x.state is XferState.PENDING:
            x.state, x.error = XferState.FAILED, TransferError(why)

    def _step(self, x: Xfer) -> None:
        sim = self.sim
        if x.state is not XferState.PENDING:
            return
        d = x.consumer
        if d.inc != x.consumer_inc or not d.up:  # its process died: nothing moves any more
            x.state = XferState.FAILED
            return
        if x.host:
            self._copy_step(x)
            return
        owner = sim.agents.get(x.agent)
        if owner is None or not owner.up or owner.agent != x.agent:
            sim.after(0.001, self._fail, x, "remote agent disconnected")
            return
        if x.mode == "fail":
            self._fail(x, "injected READ failure")
            return
        if x.mode == "hang":  # a READ the transport never ends: only a sever (or death) does
            return
        if (d.frozen or owner.frozen or sim.partitioned(d.index, owner.index)
                or (x.mode == "stall" and sim.read_fault_active(d, "stall"))):
            sim.after(0.02, self._step, x)  # no progress while either side cannot run
            return
        src = x.src
        if src is None or src.state in ("freed", "dead") or src.daemon is not owner:
            self._fail(x, "remote memory not registered")
            return
        self._copy(x, *x.pairs[x.next])
        x.next += 1
        if x.next == len(x.pairs):
            x.state = XferState.DONE
            return
        delay = sim.net_rng.uniform(0.0001, 0.002)
        if x.mode == "late" and x.next == len(x.pairs) - 1:
            delay += sim.net_rng.uniform(0.3, 2.5)
        sim.after(delay, self._step, x)

    def _copy_step(self, x: Xfer) -> None:
        """A host-path copy: the consumer's copy threads read the producer's pool file,
        mapped here. Its owner dying, freezing or being cut off changes nothing (the pages
        stay, and an engine that reused its blocks after a restart is read as it is); only
        the consumer's own process stopping stops it (its loop being busy does not)."""
        sim, d = self.sim, x.consumer
        if x.mode == "fail":
            self._fail(x, "injected copy failure")
            return
        if d.frozen or (x.mode in ("stall", "hang") and sim.read_fault_active(d, "stall")):
            sim.after(0.02, self._step, x)
            return
        self._copy(x, *x.pairs[x.next])
        x.next += 1
        if x.next == len(x.pairs):
            x.state = XferState.DONE
            return
        # A big one stands for ~a million small descriptors: seconds of copying.
        sim.after(sim.net_rng.uniform(0.02, 0.2) if x.pull.big
                  else sim.net_rng.uniform(0.0001, 0.002), self._step, x)

    def _copy(self, x: Xfer, src_at: int, dst_at: int, nbytes: int) -> None:
        """One descriptor: a whole block (``src_at``, ``dst_at`` block ids), or with
        ``Knobs.engine_block_tokens`` ``nbytes`` bytes at those offsets in the pools."""
        assert x.src is not None
        if self.sim.layout is None:
            self.write(x, dst_at, x.src.pool[src_at])
            return
        src, dst = x.src.pool.reshape(-1), x.dst.pool.reshape(-1)
        bb = x.dst.pool.shape[1]
        if dst_at + nbytes > dst.size or src_at + nbytes > src.size:
            self.sim.violate(f"READ of {x.pull.label}: descriptor ({src_at}, {dst_at}, "
                             f"{nbytes}) outside its pools")
        self.write(x, dst_at // bb, src[src_at:src_at + nbytes], dst_at,
                   (dst_at + nbytes - 1) // bb)

    def write(self, x: Xfer, block: int, data: np.ndarray, at: int = -1, last: int = -1
              ) -> None:
        """Write ``data`` into ``block`` (whole), or from byte ``at`` of the pool into
        blocks ``block`` to ``last``."""
        dst = x.dst
        for b in range(block, max(block, last) + 1):
            self._check_write(x, b)
        if at < 0:
            dst.pool[block] = data
        else:
            dst.pool.reshape(-1)[at:at + len(data)] = data

    def _check_write(self, x: Xfer, block: int) -> None:
        sim, dst = self.sim, x.dst
        rec = x.pull
        self.writes.append((sim.now, x.consumer.name, dst.engine_id, block, rec.label))
        if sim.trace is not None:
            sim.note(f"write {rec.label} x{x.id} block {block} from {x.hold_key}")
        for r in (rec, rec.parent):  # a range pull's blocks are its progressive pull's
            if r is not None and r.outcome:
                sim.violate(f"READ of {rec.label} wrote block {block} of {dst.engine_id} after "
                            f"kvd reported {r.label} {r.outcome} ({r.outcome_s:.4f}s)")
        if dst.state == "freed":
            sim.violate(f"READ of {rec.label} wrote block {block} of {dst.engine_id}'s pool "
                        f"after the pool was freed")
        if dst.state == "live" and dst.engine.reg is dst:  # the engine uses this pool
            owner = dst.engine.owner.get(block)
            if owner is not (rec.parent or rec):
                sim.violate(f"READ of {rec.label} wrote block {block} of {dst.engine_id} after "
                            f"kvd handed it back (now {owner.label if owner else 'free'})")

    def poll(self, handles: list[int]) -> dict[int, XferStatus]:
        return {h: XferStatus(self.xfers[h].state, self.xfers[h].error) for h in handles}

    def release(self, d: Daemon, handles: list[int]) -> None:
        for h in handles:
            x = self.xfers[h]
            if x.released:
                self.sim.violate(f"transfer {h} released twice")
            x.released = True  # a running READ runs on: releasing does not stop it
            d.xfers.discard(h)

    def sever(self, d: Daemon, agent: str) -> None:
        for h in list(d.xfers):
            x = self.xfers[h]
            if x.agent == agent and x.consumer_inc == d.inc:
                self._fail(x, "severed")


class FakeMover:
    """kvd.transport.base.Mover for one pull, over the simulated transport: NIXL READs,
    or (``host``) copies from the producer's mapped pool files."""

    def __init__(self, d: Daemon, rec: PullRec, host: bool, local: bool = False) -> None:
        self.d = d
        self.rec = rec
        self.host = host  # a copy (host path, or ``local``: both pools this daemon's)
        self.path = Path.LOCAL if local else Path.HOST if host else Path.REMOTE

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        return True

    def post_now(self, posts: list[ReadPost]) -> list[PostResult]:
        return self.d.sim.transport.post(self.d, posts, self.rec, self.host)

    async def post(self, posts: list[ReadPost]) -> list[PostResult]:
        return self.post_now(posts)

    async def poll(self, handles: list[int]) -> dict[int, XferStatus]:
        return self.d.sim.transport.poll(handles)

    async def release(self, handles: list[int]) -> None:
        sim, pull = self.d.sim, self.rec.pull
        for h in handles:
            if sim.transport.xfers[h].state is XferState.PENDING and (
                    pull is None or pull.cancel_reason is None):
                sim.violate(f"{self.rec.label} released transfer {h} while it runs")
        sim.transport.release(self.d, handles)

    async def sever(self, producers: Mapping[str, tuple[str, ...]]) -> None:
        """As NixlMover: the producers' data connections torn down (their READs fail),
        their cached handshakes dropped."""
        for agent, addrs in producers.items():
            self.d.sim.transport.sever(self.d, agent)
            for a in addrs:
                self.d.drop_address(a)

    def close(self) -> None:
        pass


class FakeHostMaps:
    """kvd.daemon.pull.hostmap.HostMaps of one handshake: pinned while a pull may copy;
    `owner_gone` as the real one: the daemon that owns the files died or restarted."""

    def __init__(self, sim: Sim, remote: RemoteEngine) -> None:
        self.sim = sim
        self.agents = [rd.agent for rd in remote.daemons.values()]
        self.pins = 0

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1

    def owner_gone(self) -> str:
        for agent in self.agents:
            owner = self.sim.agents.get(agent)
            if owner is None or not owner.up or owner.agent != agent:
                return f"the producer daemon {agent} died or restarted during the copy"
        return ""


def assemble(rec: PullRec, block_bytes: int, engine: FakeEngine, remote: RemoteEngine
             ) -> dict[str, ProducerReads]:
    """As kvd.daemon.pull.assemble.PullAssembler: the pull's reads from its one producer
    daemon, local addresses in the engine's pool. A big pull stands for one past
    EARLY_POST_MAX_BYTES (posted only once the Acquire's replies are in)."""
    if not engine.live_ranks():
        raise KvdError(f"engine {engine.engine_id!r} left before its READs were posted")
    (rd,) = remote.daemons.values()
    msg = rec.pull.msg if rec.pull is not None else None
    assert msg is not None
    sim = engine.daemon.sim
    # the producer's registration the handshake saw (a local pull's: in its desc)
    uid = remote.pools if remote.pools is not None else remote.desc.uid
    if sim.layout is not None:  # kvd's planner, between two real cache layouts
        return layouts.assemble(engine, sim.regs[uid], msg, rd.agent, POOL_SPAN)
    n = len(msg.local_block_ids)
    size = M.EARLY_POST_MAX_BYTES // 2 + 1 if rec.big else block_bytes
    reads = ProducerReads(owner=rd.agent, reads=1)
    reads.add(np.array(msg.local_block_ids, np.int64) + engine.uid * POOL_SPAN,
              np.array(msg.remote_block_ids, np.int64) + uid * POOL_SPAN,
              np.full(n, size, np.int64), 0, 0)
    return {rd.agent: reads}


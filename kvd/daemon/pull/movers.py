"""Movers: how a pull's bytes get from the producer's pools into the consumer's.

A pull (kvd.daemon.pull.machine) decides what to move and when; a `Mover`
(kvd.transport.base) moves it and reports each transfer's end. `NixlMover` posts NIXL
READs from another daemon's agent (kvd.daemon.datapath). The consumer chooses a pull's
mover: its route first (`Consumer.route_for`: local or network), then, for a network
pull once its handshake is known, host copy or NIXL READs (`Consumer.pick`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np

from kvd.daemon.datapath import DataPath
from kvd.daemon.engines.table import Engine
from kvd.daemon.peers.remote import RemoteEngine
from kvd.daemon.peers.table import PeerTable
from kvd.daemon.pull.actions import Notice
from kvd.daemon.pull.hostmap import host_bases
from kvd.planner.assembly import ProducerReads
from kvd.transport.base import PoolSpan, PostResult, ReadPost, XferStatus
from kvd.wire import protocol as P

log = logging.getLogger("kvd.consumer")

# Transfers of at most this many descriptors are posted on fresh lists: NIXL validates a
# few descriptors faster than kvd maps them onto prepared lists (and none merge).
FRESH_POST_MAX_DESCRIPTORS = 8


def build_posts(msg: P.Pull, engine: Engine, remote: RemoteEngine,
                groups: dict[str, ProducerReads], name_pools: bool = False
                ) -> tuple[list[ReadPost], list[Notice], int, int]:
    """The pull's transfers (one per producer daemon with descriptors), its notices (one per
    producer daemon), its bytes and its descriptors. ``name_pools``: always name them
    (a sample of the pair's pulls, whose lists are prepared ahead)."""
    posts, notices = [], []
    nbytes = descriptors = 0
    local_pools: tuple[PoolSpan, ...] | None = None
    bases = host_bases(remote)
    for g in groups.values():
        notices.append((g.owner, P.ReadNotice(
            request_id=msg.producer_request_id, producer_engine_id=msg.remote_engine_id,
            consumer_engine_id=msg.engine_id, reads=g.reads, nbytes=g.total_nbytes)))
        if not g.descriptors:  # nothing to read from this daemon: notification only
            continue
        # Pools named so that the data path posts through prepared lists; not for a few
        # descriptors: the lookup then costs more than NIXL's validation.
        # The host path names them always: the copier checks every descriptor against the
        # mapped pools (a wrong address would crash the daemon, not fail the pull).
        prepped = g.descriptors > FRESH_POST_MAX_DESCRIPTORS or bool(bases) or name_pools
        if prepped and local_pools is None:
            local_pools = tuple(PoolSpan(r.pool.addr, r.pool.nbytes, r.device_id)
                                for r in engine.live_ranks())
        posts.append(ReadPost(
            peer=g.owner, local_addrs=g.local_addrs, remote_addrs=g.remote_addrs,
            nbytes=g.nbytes, mem_type=remote.desc.mem_type, notif=b"",
            local_mem_type="" if engine.mem_type == remote.desc.mem_type else engine.mem_type,
            local_devs=g.local_devs, remote_devs=g.remote_devs, blocks=g.blocks,
            local_pools=local_pools if prepped and local_pools else (),
            remote_pools=tuple(PoolSpan(bases.get(rr.rank, rr.desc.base_addr), rr.desc.nbytes,
                                        rr.desc.device_id)
                               for rr in remote.ranks.values()
                               if rr.agent == g.owner) if prepped else ()))
        nbytes += g.total_nbytes
        descriptors += g.descriptors
    return posts, notices, nbytes, descriptors


def _arrays(posts: list[ReadPost]) -> list[ReadPost]:
    """The posts with every column an int64 array: NIXL's descriptor lists are built from
    arrays, and a small pull's assembly hands over tuples (kvd.planner.assembly)."""
    if all(type(p.nbytes) is np.ndarray for p in posts):
        return posts
    return [dataclasses.replace(
        p, **{name: np.asarray(col, dtype=np.int64)
              for name in ("local_addrs", "remote_addrs", "nbytes", "local_devs", "remote_devs")
              if (col := getattr(p, name)) is not None and type(col) is not np.ndarray})
        for p in posts]


def _host_port(address: str) -> tuple[str, int]:
    """("host", port) of a "tcp://host:port" endpoint (port 0 when there is none)."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host:
        return rest.strip("[]"), 0
    return host.strip("[]"), int(port) if port.isdigit() else 0


class NixlMover:
    """NIXL READs from another daemon's agent, through this daemon's data path."""

    path = "remote"

    def __init__(self, datapath: DataPath, peers: PeerTable, own_ports: tuple[int, ...]
                 ) -> None:
        self.datapath = datapath
        self.peers = peers
        self.own_ports = own_ports  # this daemon's listeners: never severed

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        return self.datapath.can_post_now(_arrays(posts))

    def post_now(self, posts: list[ReadPost]) -> list[PostResult] | None:
        return self.datapath.post_reads_now(_arrays(posts))

    async def post(self, posts: list[ReadPost]) -> list[PostResult]:
        return await self.datapath.post_reads(_arrays(posts))

    async def prepare(self, engine: Engine, remote: RemoteEngine,
                      sample: dict[str, ProducerReads]) -> int:
        """Ahead of a pair's first pull: the NIXL lists of the chunk its READs will use
        (kvd.transport.remote.prepped), prepared from a sample pull's reads
        (`PullAssembler.sample`), so that its first post only picks indices; and, DRAM
        to DRAM, one page read from each producer daemon (`DataPath.warm_read`: the
        transport's first-READ costs, paid now). How many READs of the sample would go
        through prepared lists."""
        msg = P.Pull(engine_id=engine.engine_id, request_id="warm-up",
                     remote_engine_id=remote.desc.engine_id, remote_address="",
                     remote_block_ids=[], local_block_ids=[])
        posts = _arrays(build_posts(msg, engine, remote, sample, name_pools=True)[0])
        prepared = await self.datapath.prepare_reads(posts)
        if engine.mem_type == "DRAM":  # a DRAM page takes the READ, in this side's memory
            for post in posts:  # and the READ's first one to each producer daemon
                if post.mem_type == "DRAM" and len(post.remote_addrs):
                    await self.datapath.warm_read(post.peer, int(post.remote_addrs[0]),
                                                  int(post.nbytes[0]))
        return prepared

    async def poll(self, handles: list[int]) -> dict[int, XferStatus]:
        return await self.datapath.poll_many(handles)

    async def release(self, handles: list[int]) -> None:
        await self.datapath.release(handles)

    async def sever(self, producers: Mapping[str, tuple[str, ...]]) -> None:
        """Tear down the data connections to each producer (`Transport.sever_peer`),
        sparing the daemon's own sockets (its listeners, the peer's control port); a
        producer whose connections could not be torn down (an RDMA fabric) keeps its
        READs until the transport ends them."""
        transport = self.datapath.transport
        for agent, addrs in producers.items():
            hosts = tuple(sorted({_host_port(a)[0] for a in addrs}))
            spare_remote = tuple(sorted({_host_port(a)[1] for a in addrs}))
            shut = await self.datapath.call(transport.sever_peer, agent, hosts,
                                            self.own_ports, spare_remote)
            if shut:  # its NIXL endpoint fails now: the next pull loads the peer afresh
                for addr in addrs:
                    self.peers.drop_address(addr, "READ connections severed")
            else:
                log.warning("no connection to %s could be torn down: the pull stays "
                            "quarantined until the transport ends its READ", agent)

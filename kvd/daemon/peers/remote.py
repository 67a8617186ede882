"""A remote engine as this daemon learnt it by handshakes: values, no I/O (the pull's
machine and its rules read them; kvd.daemon.peers.table greets and caches them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from kvd.daemon.engines.table import compat_hash
from kvd.planner import RankId
from kvd.wire import protocol as P


@dataclass(frozen=True)
class RemoteDaemon:
    address: str
    agent: str  # NIXL agent name
    instance: str  # incarnation that answered the handshake
    epoch: int  # the engine's epoch on that daemon at handshake time
    host_token: str = ""  # its host (kvd.transport.samehost.discovery), "" from an older daemon


@dataclass
class RemoteRank:
    rank: RankId
    daemon: str  # peer address
    agent: str
    desc: P.RankDesc
    pool_file: P.PoolFile = P.PoolFile()  # its pool's file on its host ("" path: none)


@dataclass
class RemoteEngine:
    """A remote engine as learned by handshakes with every daemon hosting its ranks."""

    desc: P.EngineDesc  # geometry (ranks field: as reported by the first daemon)
    ranks: dict[RankId, RemoteRank] = field(default_factory=dict)
    daemons: dict[str, RemoteDaemon] = field(default_factory=dict)  # by peer address
    pools: Any = None  # (parallelism, rank pools) for the assembly, built at first use
    route: Any = None  # the consumer's choice of path for this handshake (host or remote)
    via: str = ""  # the daemon address it was greeted through (the pulls' remote_address)

    @functools.cached_property
    def compat(self) -> str:
        return compat_hash(self.desc.model, self.desc.layout)

"""Pulls from another daemon on this host: its DRAM pool files mapped here, a copy.

Two daemons on one host (one sidecar per engine pod) need not move bytes through the
network stack: when the producer daemon's handshake says it runs on this kernel and
its pool directory (or IPC namespace) is ours, the consumer daemon maps each of the
producer's pool files read-only and copies from them (the "host" path, with the copier
of a local pull). Everything else stays as for a remote pull: the Acquire, the lease
heartbeats, the READ notice and the abandon go to the producer daemon over the network,
so its hold, lease and consumer count work unchanged, and the hold is released only
by the notice the consumer sends once the copy ended.

`host_reach` decides (pure: facts in, answer out), once per handshake; `HostMaps` are
one handshake's mappings. A mapping is never unmapped while a pull may copy from it
(each pull that chose it pins it until it reported, after its copies ended); it is
retired when its handshake is dropped or replaced or the producer freed the pool
(the file unlinked), and unmapped at the last unpin, so a freed producer pool is not
kept alive by us beyond the pulls that were reading it.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from kvd.daemon.peers.remote import RemoteEngine
from kvd.planner import RankId
from kvd.pool.owner import OwnerWatch, owner_lock_name
from kvd.pool.prefault import MADV_POPULATE_READ, Prefault
from kvd.transport.samehost.discovery import (
    HostFacts,
    Reach,
    dram_reachable,
    parse_host_token,
    stat_dir,
)

log = logging.getLogger("kvd.consumer")

MAX_MAPPED_HANDSHAKES = 256
DEFAULT_POOL_DIR = "/dev/shm"  # bound: past it the oldest retired ones are already gone


def host_reach(mine: HostFacts, remote: RemoteEngine,
               dir_here: Callable[[str], tuple[int, int] | None] = stat_dir) -> Reach:
    """Whether every pool of ``remote`` (a handshake) can be mapped here, and why (not).

    Every daemon hosting one of its ranks must be on this kernel with its pool directory
    or IPC namespace shared with us (kvd.transport.samehost.discovery.dram_reachable), and every
    rank's pool must be a file (memfd pools have no path to open). Whether each file is
    really there is checked when it is mapped (`HostMaps.open`)."""
    if remote.desc.mem_type != "DRAM":
        return Reach(False, "", f"{remote.desc.mem_type} pools: the host path maps DRAM "
                     "pool files only")
    how, why = "", ""
    dirs = {DEFAULT_POOL_DIR}  # where a pool falls back to (a hugetlbfs mount out of pages)
    for addr, d in sorted(remote.daemons.items()):
        if not d.host_token:
            return Reach(False, "", f"the producer daemon {addr} does not say which host "
                         "it runs on (an older kvd)")
        try:
            peer = parse_host_token(d.host_token)
        except ValueError as exc:
            return Reach(False, "", f"the producer daemon {addr}: {exc}")
        dirs.add(peer.pool_dir)
        reach = dram_reachable(mine, peer, dir_here(peer.pool_dir))
        if not reach.ok:
            return reach
        how, why = reach.how, reach.reason
    for rid, rr in sorted(remote.ranks.items()):
        if not rr.pool_file.path:
            return Reach(False, "", f"same host, but rank {rid.key}'s pool has no file "
                         "(a memfd pool, pool_backing memfd or memfd_hugetlb): memfd pools "
                         "are not reachable by path; use a file backing or one daemon")
        # Only files in a pool directory are opened: a peer names paths, we map them.
        if os.path.dirname(os.path.normpath(rr.pool_file.path)) not in dirs:
            return Reach(False, "", f"rank {rid.key}'s pool file {rr.pool_file.path} is not "
                         "in the producer's pool directory")
    return Reach(True, how, why)


@dataclass
class _Mapped:
    fd: int
    mm: mmap.mmap
    view: np.ndarray  # keeps the address; dropped before the mapping is closed
    path: str
    prefault: Prefault | None = None  # its pages mapped here ahead of the copies


@dataclass
class HostMaps:
    """One handshake's producer pool files, mapped read-only here.

    ``bases``: the mapped address of each rank's pool (in place of its address in the
    producer's process). Pinned by each pull that chose it (`pin`/`unpin`); `retire`
    marks it unusable for new pulls, and it is unmapped once retired and unpinned."""

    bases: dict[RankId, int]
    files: list[_Mapped] = field(default_factory=list)
    owners: list[OwnerWatch] = field(default_factory=list)  # the pools' owner incarnations
    refs: int = 0
    retired: bool = False
    closed: bool = False

    @classmethod
    def open(cls, remote: RemoteEngine) -> HostMaps:
        """Map every rank's pool file; OSError (with the reason) when one cannot be: not
        there, another file at that path, smaller than the pool, or not readable. Nothing
        stays mapped on failure. Also the owner lock of every pool file: a copy is
        trusted only while the incarnation that owns its source is alive (`owner_gone`);
        a pool whose owner cannot be watched is not mapped."""
        maps = cls(bases={})
        try:
            maps._watch_owners(remote)
            for rid, rr in sorted(remote.ranks.items()):
                f = rr.pool_file
                fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != (f.dev, f.ino):
                        raise OSError(f"{f.path} is another file here (device/inode "
                                      f"{st.st_dev}:{st.st_ino}, the producer's "
                                      f"{f.dev}:{f.ino})")
                    if st.st_size < rr.desc.nbytes:
                        raise OSError(f"{f.path} holds {st.st_size} bytes, less than the "
                                      f"pool's {rr.desc.nbytes}")
                    mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
                except BaseException:
                    os.close(fd)
                    raise
                view = np.frombuffer(mm, dtype=np.uint8)
                # the pages exist (the producer's): only this process's page tables, on
                # a thread, so that later copies do not fault them in one by one
                ahead = Prefault(int(view.ctypes.data), len(mm), f.path,
                                 MADV_POPULATE_READ).start()
                maps.files.append(_Mapped(fd, mm, view, f.path, ahead))
                maps.bases[rid] = int(view.ctypes.data)
        except BaseException:
            maps._unmap()
            raise
        return maps

    def _watch_owners(self, remote: RemoteEngine) -> None:
        dirs = []
        for d in remote.daemons.values():
            try:
                dirs.append(parse_host_token(d.host_token).pool_dir)
            except ValueError:
                continue
        seen: set[str] = set()
        for rid, rr in sorted(remote.ranks.items()):
            path = rr.pool_file.path
            name = owner_lock_name(os.path.basename(path))
            if name is None:
                raise OSError(f"{path}: not named after a kvd incarnation (an older kvd?): "
                              "a copy from it could not be confirmed")
            for d in (os.path.dirname(path), *dirs):
                lock = os.path.join(d, name)
                if lock in seen:
                    break
                try:
                    watch = OwnerWatch(lock)
                except FileNotFoundError:
                    continue
                self.owners.append(watch)
                seen.add(lock)
                if not watch.alive():
                    raise OSError(f"{lock}: the daemon incarnation that owns rank "
                                  f"{rid.key}'s pool is not alive")
                break
            else:
                raise OSError(f"{path}: its owner's lock file {name} is not in the "
                              "producer's pool directory")

    def owner_gone(self) -> str:
        """Why a copy from these files cannot be trusted now ("" when it can): the daemon
        incarnation owning one of them died or stopped since they were mapped, so a
        successor may have adopted the pool and its engine reused the blocks."""
        for watch in self.owners:
            if not watch.alive():
                return (f"the producer daemon that owns {os.path.basename(watch.path)[:-5]}'s "
                        "pools died or restarted during the copy")
        return ""

    def pin(self) -> None:
        assert not self.closed
        self.refs += 1

    def unpin(self) -> None:
        assert self.refs > 0
        self.refs -= 1
        if self.retired and self.refs == 0:
            self._unmap()

    def retire(self) -> None:
        """No new pull may choose it; unmapped now, or at the last pull's unpin."""
        self.retired = True
        if self.refs == 0:
            self._unmap()

    def freed(self) -> bool:
        """Whether the producer removed one of the files (its pool freed): only our
        mapping keeps those pages alive then."""
        for f in self.files:
            try:
                if os.fstat(f.fd).st_nlink == 0:
                    return True
            except OSError:
                return True
        return False

    def _unmap(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.bases = {}
        for watch in self.owners:
            watch.close()
        self.owners = []
        for f in self.files:
            if f.prefault is not None:  # not past the mapping's end
                f.prefault.stop()
            f.view = np.empty(0, np.uint8)  # drop the buffer export before closing
            try:
                f.mm.close()
            finally:
                os.close(f.fd)
        self.files = []


@dataclass(frozen=True)
class HostRoute:
    """The consumer's choice for one handshake (stored as ``RemoteEngine.route``)."""

    path: str  # "host" or "remote"
    why: str  # one line for kvd status
    maps: HostMaps | None = None


def host_bases(remote: RemoteEngine) -> dict[RankId, int]:
    """Where each rank's pool is mapped here, for a handshake on the host path ({}: not)."""
    route = remote.route
    maps = getattr(route, "maps", None)
    return dict(maps.bases) if maps is not None and not maps.closed else {}


class HostMapper:
    """Every handshake's choice and mappings, for one consumer daemon.

    `choose` decides once per handshake (a new handshake object is a new decision) and
    maps the files when the host path is possible; `sweep` retires the mappings of
    handshakes no longer cached (dropped or replaced) or whose producer freed a pool;
    `close` unmaps everything (the daemon stops, after every copy ended)."""

    def __init__(self, mine: HostFacts, enabled: bool = True,
                 dir_here: Callable[[str], tuple[int, int] | None] = stat_dir) -> None:
        self.mine = mine
        self.enabled = enabled
        self.dir_here = dir_here
        self.live: dict[int, tuple[RemoteEngine, HostMaps]] = {}  # id(handshake) ->

    def choose(self, remote: RemoteEngine) -> HostRoute | None:
        """The handshake's route, decided at its first pull; None when its mappings were
        retired meanwhile (the handshake is stale: greet again)."""
        route = remote.route
        if isinstance(route, HostRoute):
            if route.maps is not None and route.maps.retired:
                return None
            return route
        route = self._decide(remote)
        remote.route = route
        if route.maps is not None:
            if len(self.live) >= MAX_MAPPED_HANDSHAKES:
                # Bounded: retire the oldest (unmapped once its pulls ended).
                oldest = next(iter(self.live))
                self.live.pop(oldest)[1].retire()
            self.live[id(remote)] = (remote, route.maps)
            log.info("pulls from %s map its pool files (%s)", remote.desc.engine_id,
                     route.why)
        return route

    def _decide(self, remote: RemoteEngine) -> HostRoute:
        if not self.enabled:
            return HostRoute("remote", "host_pulls is off")
        reach = host_reach(self.mine, remote, self.dir_here)
        if not reach.ok:
            return HostRoute("remote", reach.reason)
        try:
            maps = HostMaps.open(remote)
        except OSError as exc:
            why = exc.strerror and f"{exc.filename or ''}: {exc.strerror}" or str(exc)
            return HostRoute("remote", f"same host, but a pool file cannot be mapped "
                             f"here ({why})")
        return HostRoute("host", reach.reason, maps)

    def sweep(self, cached: Iterable[RemoteEngine]) -> list[RemoteEngine]:
        """Retire the mappings of handshakes not in ``cached`` any more, and of those whose
        producer freed a pool; the latter are returned (their handshake is stale: the
        caller forgets it)."""
        keep = {id(r) for r in cached}
        stale = []
        for key, (remote, maps) in list(self.live.items()):
            gone = key not in keep
            if gone or maps.freed():
                del self.live[key]
                maps.retire()
                if not gone:
                    stale.append(remote)
        return stale

    def close(self) -> None:
        """The daemon stops, every copy ended (the copier closed first): unmap all."""
        for _, maps in self.live.values():
            maps.retired = True
            maps._unmap()
        self.live.clear()

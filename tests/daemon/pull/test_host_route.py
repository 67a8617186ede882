"""The host path's decision (`host_reach`, `HostMapper.choose`) and its mappings' life
(`HostMaps`: pinned by pulls, unmapped once retired and unpinned, never before)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine, RemoteRank
from kvd.daemon.pull.hostmap import HostMapper, HostMaps, host_bases, host_reach
from kvd.planner import RankId
from kvd.pool.owner import PoolOwner
from kvd.transport.samehost.discovery import HostFacts, same_host_token
from kvd.wire import protocol as P

NBYTES = 1 << 16


def _facts(boot: str = "b1", ipc: int = 11, pool_dir: str = "/dev/shm",
           dir_id: tuple[int, int] = (5, 6)) -> HostFacts:
    return HostFacts(boot_id=boot, machine_id="m", ipc_ns=ipc, pool_dir=pool_dir,
                     pool_dir_dev=dir_id[0], pool_dir_ino=dir_id[1])


def _engine(files: list[P.PoolFile], token: str, mem_type: str = "DRAM") -> RemoteEngine:
    model = P.ModelSpec(name="m", num_kv_heads=1, num_layers=1, head_dim=8)
    layout = P.LayoutSpec(num_blocks=4, block_size_tokens=16)
    ranks = [P.RankDesc(tp_rank=i, pp_rank=0, base_addr=0x1000 * (i + 1), nbytes=NBYTES,
                        num_blocks=4) for i in range(len(files))]
    desc = P.EngineDesc(engine_id="pre", model=model, layout=layout, tp_size=len(files),
                        pp_size=1, layer_partition=None, ranks=ranks, mem_type=mem_type)
    remote = RemoteEngine(desc=desc)
    remote.daemons["tcp://127.0.0.1:1"] = RemoteDaemon("tcp://127.0.0.1:1", "agent", "inst",
                                                       0, token)
    for r, f in zip(ranks, files, strict=True):
        rid = RankId(r.tp_rank, 0)
        remote.ranks[rid] = RemoteRank(rid, "tcp://127.0.0.1:1", "agent", r, f)
    return remote


_OWNERS: dict[Path, PoolOwner] = {}


def _owner(tmp: Path) -> PoolOwner:
    """The live producer incarnation whose pool files ``tmp`` holds (its lock held by
    this process until the test's directory goes)."""
    if tmp not in _OWNERS:
        _OWNERS[tmp] = PoolOwner.acquire(tmp, "kvdt")
    return _OWNERS[tmp]


def _file(tmp: Path, name: str, fill: int) -> P.PoolFile:
    """A pool file named as its owner incarnation names them (``name`` only tells the
    files of a test apart)."""
    path = tmp / _owner(tmp).pool_name()
    path.write_bytes(bytes([fill]) * NBYTES)
    st = os.stat(path)
    return P.PoolFile(path=str(path), dev=st.st_dev, ino=st.st_ino)


FILES = [P.PoolFile(path="/dev/shm/a", dev=1, ino=2)]


def test_same_kernel_and_shared_pool_dir_is_reachable() -> None:
    remote = _engine(FILES, same_host_token(_facts(ipc=99)))
    reach = host_reach(_facts(ipc=11), remote, lambda _: (5, 6))
    assert reach.ok and reach.how == "shared_pool_dir", reach


def test_same_ipc_namespace_is_reachable_without_a_shared_dir() -> None:
    remote = _engine(FILES, same_host_token(_facts(pool_dir="/elsewhere", dir_id=(8, 9))))
    reach = host_reach(_facts(), remote, lambda _: None)
    assert reach.ok and reach.how == "same_ipc_namespace", reach


@pytest.mark.parametrize(("peer", "mine", "dir_here", "why"), [
    (_facts(boot="b2"), _facts(), (5, 6), "another host"),
    (_facts(ipc=12, dir_id=(5, 6)), _facts(ipc=11), (7, 7), "another IPC namespace"),
    (_facts(ipc=12), _facts(ipc=11), None, "missing here"),
    (_facts(boot=""), _facts(), (5, 6), "host unknown"),
])
def test_other_hosts_and_namespaces_are_not(peer, mine, dir_here, why) -> None:
    reach = host_reach(mine, _engine(FILES, same_host_token(peer)), lambda _: dir_here)
    assert not reach.ok and why in reach.reason, reach


def test_memfd_pools_vram_and_older_daemons_are_not() -> None:
    token = same_host_token(_facts())
    memfd = host_reach(_facts(), _engine([P.PoolFile()], token), lambda _: (5, 6))
    assert not memfd.ok and "memfd pools are not reachable by path" in memfd.reason
    vram = host_reach(_facts(), _engine(FILES, token, "VRAM"), lambda _: (5, 6))
    assert not vram.ok and "VRAM" in vram.reason
    old = host_reach(_facts(), _engine(FILES, ""), lambda _: (5, 6))
    assert not old.ok and "older kvd" in old.reason
    bad = host_reach(_facts(), _engine(FILES, "kvdhost9;x"), lambda _: (5, 6))
    assert not bad.ok and "host token" in bad.reason
    outside = [P.PoolFile(path="/etc/passwd", dev=1, ino=2)]
    out = host_reach(_facts(), _engine(outside, token), lambda _: (5, 6))
    assert not out.ok and "not in the producer's pool directory" in out.reason


def test_the_choice_is_made_once_per_handshake_and_maps_the_files(tmp_path) -> None:
    files = [_file(tmp_path, "p0", 7), _file(tmp_path, "p1", 9)]
    mine = _facts(dir_id=(1, 1))
    mapper = HostMapper(mine, dir_here=lambda _: (1, 1))
    peer = _facts(pool_dir=str(tmp_path), dir_id=(1, 1))
    remote = _engine(files, same_host_token(peer))
    route = mapper.choose(remote)
    assert route is not None and route.path == "host" and route.maps is not None
    assert mapper.choose(remote) is route  # once per handshake
    bases = host_bases(remote)
    assert ctypes.string_at(bases[RankId(0, 0)], 4) == b"\x07" * 4
    assert ctypes.string_at(bases[RankId(1, 0)] + NBYTES - 4, 4) == b"\x09" * 4
    # A new handshake replaces it: the old mappings go (no pull pins them).
    again = _engine(files, same_host_token(peer))
    mapper.choose(again)
    assert mapper.sweep([again]) == []
    assert route.maps.closed and mapper.choose(remote) is None  # stale: greet again
    mapper.close()


def test_a_file_that_is_not_the_producers_falls_back_with_the_reason(tmp_path) -> None:
    f = _file(tmp_path, "p0", 1)
    wrong = P.PoolFile(path=f.path, dev=f.dev, ino=f.ino + 1)
    peer = _facts(pool_dir=str(tmp_path))
    mapper = HostMapper(_facts(), dir_here=lambda _: (5, 6))
    route = mapper.choose(_engine([wrong], same_host_token(peer)))
    assert route is not None and route.path == "remote" and "another file here" in route.why
    gone = P.PoolFile(path=str(tmp_path / _owner(tmp_path).pool_name()), dev=1, ino=2)
    route = mapper.choose(_engine([gone], same_host_token(peer)))
    assert route is not None and route.path == "remote" and "cannot be mapped" in route.why
    off = HostMapper(_facts(), enabled=False, dir_here=lambda _: (5, 6))
    route = off.choose(_engine([f], same_host_token(peer)))
    assert route is not None and route.path == "remote" and route.why == "host_pulls is off"


def test_mappings_stay_while_a_pull_pins_them(tmp_path) -> None:
    f = _file(tmp_path, "p0", 3)
    maps = HostMaps.open(_engine([f], ""))
    base = maps.bases[RankId(0, 0)]
    maps.pin()
    maps.pin()
    maps.retire()
    assert not maps.closed and ctypes.string_at(base, 2) == b"\x03\x03"
    maps.unpin()
    assert not maps.closed
    maps.unpin()
    assert maps.closed and maps.bases == {}


def test_a_freed_producer_pool_is_unmapped_and_its_handshake_reported(tmp_path) -> None:
    f = _file(tmp_path, "p0", 4)
    peer = _facts(pool_dir=str(tmp_path))
    mapper = HostMapper(_facts(), dir_here=lambda _: (5, 6))
    remote = _engine([f], same_host_token(peer))
    route = mapper.choose(remote)
    assert route is not None and route.maps is not None
    route.maps.pin()  # a pull copying from it
    assert mapper.sweep([remote]) == []
    os.unlink(f.path)  # the producer freed its pool
    assert mapper.sweep([remote]) == [remote]
    assert not route.maps.closed  # the pull still copies
    route.maps.unpin()
    assert route.maps.closed
    fd_dir = Path("/proc/self/fd")
    assert not any(os.readlink(fd_dir / x).startswith(f.path) for x in os.listdir(fd_dir)
                   if (fd_dir / x).is_symlink() and os.path.exists(fd_dir / x))


def test_a_copy_is_trusted_only_while_the_files_owner_lives(tmp_path) -> None:
    f = _file(tmp_path, "p0", 5)
    maps = HostMaps.open(_engine([f], ""))
    assert maps.owner_gone() == ""
    owner = _OWNERS.pop(tmp_path)
    os.close(owner.fd)  # the producer daemon dies (its flock goes; its files stay)
    assert "died or restarted" in maps.owner_gone()
    maps.retire()
    with pytest.raises(OSError, match="not alive"):  # a dead owner's files are not mapped
        HostMaps.open(_engine([f], ""))


def test_a_file_not_named_after_an_incarnation_is_not_mapped(tmp_path) -> None:
    path = tmp_path / "p0"
    path.write_bytes(b"\0" * NBYTES)
    st = os.stat(path)
    with pytest.raises(OSError, match="not named after a kvd incarnation"):
        HostMaps.open(_engine([P.PoolFile(path=str(path), dev=st.st_dev, ino=st.st_ino)], ""))

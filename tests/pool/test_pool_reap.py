"""Crash leftovers: pool files of a SIGKILLed daemon are reaped at the
next start; a live daemon's files (another process, or another daemon of this process,
sharing the directory) and files of older kvd versions are never touched."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.standin import scratch_shm_dir, start_standin

from kvd.errors import InvalidRequestError
from kvd.pool.adopt import adopt_file
from kvd.pool.mapping import MappedPool, map_pool
from kvd.pool.owner import PoolOwner, reap_dead_pools
from kvd.pool.shm import ShmPool, kvd_segments
from kvd.wire.protocol import PoolHandle

PREFIX = "kvd-reaptest"

@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with scratch_shm_dir("kvd-reaptest") as d:
        yield d


def _start(directory: Path) -> tuple[subprocess.Popen, str, list[str]]:
    return start_standin(directory, PREFIX)


def test_sigkilled_daemons_pools_are_reaped_live_ones_kept(shm_dir: Path) -> None:
    dead, dead_id, dead_pools = _start(shm_dir)
    alive, alive_id, alive_pools = _start(shm_dir)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        legacy = shm_dir / f"{PREFIX}-{dead.pid}-0123456789ab"  # an older kvd's pool file
        legacy.write_bytes(b"x")
        assert set(dead_pools + alive_pools) <= set(kvd_segments(PREFIX, shm_dir))

        # This process is a new daemon: its own lock first, then reap. A second daemon in
        # this same process shares the directory too.
        me = PoolOwner.acquire(shm_dir, PREFIX)
        sibling = PoolOwner.acquire(shm_dir, PREFIX)
        mine = ShmPool.create(PREFIX, 1 << 20, shm_dir, owner=me)
        theirs = ShmPool.create(PREFIX, 1 << 20, shm_dir, owner=sibling)
        reaped = reap_dead_pools(shm_dir, PREFIX)

        assert sorted(reaped) == sorted(dead_pools)
        left = set(os.listdir(shm_dir))
        assert not set(dead_pools) & left
        assert f"{PREFIX}-{dead_id}.lock" not in left
        assert set(alive_pools) <= left and f"{PREFIX}-{alive_id}.lock" in left
        assert {mine.name, theirs.name, me.lock_path.name, sibling.lock_path.name} <= left
        assert legacy.name in left, "files without an owner lock are not ours to judge"
        assert alive.poll() is None
        assert reap_dead_pools(shm_dir, PREFIX) == []  # nothing more to do

        # Once the live daemon dies too, the next start reaps its files.
        alive.send_signal(signal.SIGKILL)
        alive.wait(10)
        assert sorted(reap_dead_pools(shm_dir, PREFIX)) == sorted(alive_pools)
        mine.close()
        theirs.close()
        me.release()
        sibling.release()
        assert set(os.listdir(shm_dir)) == {legacy.name}
    finally:
        for p in (dead, alive):
            if p.poll() is None:
                p.kill()
                p.wait()


def _map(shm_dir: Path, name: str) -> MappedPool:
    return map_pool(PoolHandle(kind="shm", name=name, nbytes=1 << 20, shape=[1 << 20],
                               dtype="uint8", directory=str(shm_dir)))


def test_a_pool_a_live_engine_maps_is_kept_until_it_unmaps(shm_dir: Path) -> None:
    """The reap never deletes memory a live engine still uses (it holds
    a shared flock on the file); once the engine unmaps, the next reap removes it."""
    dead, dead_id, pools = _start(shm_dir)
    try:
        mapped = _map(shm_dir, pools[0])
        dead.kill()
        dead.wait(10)
        assert reap_dead_pools(shm_dir, PREFIX) == [pools[1]]
        assert pools[0] in os.listdir(shm_dir), "a mapped pool was reaped"
        assert f"{PREFIX}-{dead_id}.lock" in os.listdir(shm_dir)  # for the next reap
        assert mapped.array[:4].tolist() == [1, 2, 3, 4]
        again = _map(shm_dir, pools[0])  # the file is the engine's memory, bytes intact
        assert again.array[:4].tolist() == [1, 2, 3, 4]
        again.close()
        assert reap_dead_pools(shm_dir, PREFIX) == []  # still mapped: still kept
        mapped.close()
        assert reap_dead_pools(shm_dir, PREFIX) == [pools[0]]
        assert os.listdir(shm_dir) == []
    finally:
        if dead.poll() is None:
            dead.kill()
            dead.wait()


def test_a_new_daemon_adopts_a_kept_pool_and_refuses_what_it_must(shm_dir: Path) -> None:
    dead, dead_id, pools = _start(shm_dir)
    alive, _, alive_pools = _start(shm_dir)
    me = PoolOwner.acquire(shm_dir, PREFIX)
    try:
        mapped = _map(shm_dir, pools[0])
        dead.kill()
        dead.wait(10)
        reap_dead_pools(shm_dir, PREFIX)

        def refused(name: str, nbytes: int = 1 << 20, directory: Path = shm_dir) -> str:
            with pytest.raises(InvalidRequestError) as info:
                adopt_file(name, nbytes, directory, me)
            return str(info.value)

        assert "alive" in refused(alive_pools[0])  # another live daemon's pool
        assert "named" in refused("unrelated")
        assert "maps" in refused(pools[0], nbytes=3 << 20)  # not the geometry's size
        assert "memfd" in refused("7", directory=Path("/proc/1/fd"))
        assert "No such file" in refused(pools[1])  # reaped: nothing to adopt

        pool = adopt_file(pools[0], 1 << 20, shm_dir, me)
        assert pool.name.startswith(f"{PREFIX}-{me.owner_id}-")  # now this owner's
        assert pools[0] not in os.listdir(shm_dir)
        assert f"{PREFIX}-{dead_id}.lock" not in os.listdir(shm_dir)  # nothing left of it
        assert pool.array[:4].tolist() == [1, 2, 3, 4]  # the same bytes, never moved
        pool.array[4] = 9
        assert mapped.array[4] == 9  # one memory, two mappings
        assert "No such file" in refused(pools[0])  # adopted once only
        mapped.close()
        pool.close()
        assert pool.name not in os.listdir(shm_dir)
    finally:
        me.release()
        for p in (dead, alive):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_adoption_given_back_leaves_the_file_as_the_engine_knows_it(shm_dir: Path) -> None:
    """give_back (a registration failed after the adoption): the file is back under the
    name in the engine's handle, bytes intact, and can be adopted again."""
    dead, _, pools = _start(shm_dir)
    me = PoolOwner.acquire(shm_dir, PREFIX)
    try:
        mapped = _map(shm_dir, pools[0])
        dead.kill()
        dead.wait(10)
        pool = adopt_file(pools[0], 1 << 20, shm_dir, me)
        pool.give_back()
        assert pools[0] in os.listdir(shm_dir) and pool.name not in os.listdir(shm_dir)
        again = adopt_file(pools[0], 1 << 20, shm_dir, me)
        assert again.array[:4].tolist() == [1, 2, 3, 4] == mapped.array[:4].tolist()
        mapped.close()
        again.close()
    finally:
        me.release()
        if dead.poll() is None:
            dead.kill()
            dead.wait()


def test_other_prefixes_and_unrelated_files_untouched(shm_dir: Path) -> None:
    dead, _, pools = _start(shm_dir)
    dead.kill()
    dead.wait(10)
    (shm_dir / "unrelated").write_bytes(b"")
    assert reap_dead_pools(shm_dir, "kvd-other") == []
    assert reap_dead_pools(shm_dir, "kvd") == []  # a prefix of PREFIX: no match either
    assert set(pools) <= set(os.listdir(shm_dir))
    assert sorted(reap_dead_pools(shm_dir, PREFIX)) == sorted(pools)
    assert reap_dead_pools(shm_dir / "missing", PREFIX) == []


def test_pools_in_the_fallback_directory_are_reaped_too(shm_dir: Path, tmp_path: Path) -> None:
    proc, _, pools = start_standin(shm_dir, PREFIX, pool_dir=tmp_path)
    proc.kill()
    proc.wait(10)
    assert set(pools) <= set(os.listdir(tmp_path))
    assert sorted(reap_dead_pools(shm_dir, PREFIX, pool_dirs=(tmp_path,))) == sorted(pools)
    assert os.listdir(tmp_path) == [] and os.listdir(shm_dir) == []

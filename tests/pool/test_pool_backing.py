"""Pool backings: auto picks huge pages where the host offers them, forced ones fail
clearly, and an engine in another process maps every kind of pool by its handle.

Real huge-page cases run where the host has them (reserved 2 MiB pages; a hugetlbfs or
huge=always tmpfs mount, found in /proc/mounts or named by KVD_TEST_HUGETLBFS_DIR /
KVD_TEST_HUGE_TMPFS_DIR) and skip elsewhere; the choice logic is tested with the host's
answers faked.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvd.pool.shm as pool_mod
from kvd.errors import KvdError
from kvd.pool.owner import PoolOwner, reap_dead_pools
from kvd.pool.shm import (
    HUGE_PAGE_NBYTES,
    MountInfo,
    PoolBacking,
    ShmPool,
    hugepages_free_nbytes,
    mount_of,
    page_stats,
)

PREFIX = "kvd-backingtest"
NBYTES = 4 << 20


def _writable_mount(kind: str, env: str) -> Path | None:
    if os.environ.get(env):
        return Path(os.environ[env])
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        info = MountInfo(parts[1], parts[2], tuple(parts[3].split(",")))
        ok = info.is_hugetlbfs if kind == "hugetlbfs" else info.is_huge_tmpfs
        if ok and os.access(parts[1], os.W_OK):
            return Path(parts[1])
    return None


HUGETLBFS_DIR = _writable_mount("hugetlbfs", "KVD_TEST_HUGETLBFS_DIR")
HUGE_TMPFS_DIR = _writable_mount("tmpfs", "KVD_TEST_HUGE_TMPFS_DIR")


def _engine_reads(handle_json: bytes) -> bytes:
    """Map the pool in another process, as an engine would, and return its first bytes
    after writing a reply after them."""
    code = (
        "import sys, msgspec\n"
        "from kvd.pool.mapping import map_pool\n"
        "from kvd.wire.protocol import PoolHandle\n"
        "h = msgspec.json.decode(sys.stdin.buffer.read(), type=PoolHandle)\n"
        "m = map_pool(h)\n"
        "sys.stdout.buffer.write(bytes(m.array[:4]))\n"
        "m.array[4:6] = [42, 43]\n"
        "m.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=handle_json, capture_output=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout


def _round_trip(pool: ShmPool) -> None:
    import msgspec

    pool.array[:4] = [1, 2, 3, 4]
    got = _engine_reads(msgspec.json.encode(pool.handle((NBYTES,), "uint8")))
    assert got == bytes([1, 2, 3, 4])
    assert pool.array[4:6].tolist() == [42, 43]


@pytest.mark.skipif(hugepages_free_nbytes() < 2 * NBYTES, reason="no free reserved huge pages")
def test_memfd_hugetlb_pool_engine_maps_it() -> None:
    fds = len(os.listdir("/proc/self/fd"))
    pool = ShmPool.create(PREFIX, NBYTES, backing="memfd_hugetlb")
    assert pool.backing is PoolBacking.MEMFD_HUGETLB and pool.page_nbytes == HUGE_PAGE_NBYTES
    assert str(pool.directory) == f"/proc/{os.getpid()}/fd"
    pool.array[:] = 1  # fault it in
    stats = page_stats(pool.addr, NBYTES)
    assert stats["Shared_Hugetlb"] + stats["Private_Hugetlb"] >= NBYTES // 1024
    _round_trip(pool)
    pool.close()
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.skipif(hugepages_free_nbytes() < 2 * NBYTES, reason="no free reserved huge pages")
def test_auto_prefers_reserved_huge_pages_over_plain_shm() -> None:
    pool = ShmPool.create(PREFIX, NBYTES, "/dev/shm", backing="auto")
    try:
        assert pool.backing is PoolBacking.MEMFD_HUGETLB
    finally:
        pool.close()


@pytest.mark.skipif(HUGETLBFS_DIR is None, reason="no writable hugetlbfs mount")
def test_hugetlbfs_pool_engine_maps_it() -> None:
    if hugepages_free_nbytes() < 2 * NBYTES:
        pytest.skip("no free reserved huge pages")
    assert HUGETLBFS_DIR is not None
    owner = PoolOwner.acquire(HUGETLBFS_DIR, PREFIX)  # lock files work on hugetlbfs too
    for backing in ("hugetlbfs", "auto"):
        pool = ShmPool.create(PREFIX, NBYTES, HUGETLBFS_DIR, backing=backing, owner=owner)
        assert pool.backing is PoolBacking.HUGETLBFS and pool.page_nbytes >= HUGE_PAGE_NBYTES
        _round_trip(pool)
        pool.close()
        assert pool.name not in os.listdir(HUGETLBFS_DIR)
    assert reap_dead_pools(HUGETLBFS_DIR, PREFIX) == []  # our own lock: alive
    owner.release()
    assert owner.lock_path.name not in os.listdir(HUGETLBFS_DIR)


@pytest.mark.skipif(HUGE_TMPFS_DIR is None, reason="no writable tmpfs mounted huge=always")
def test_huge_tmpfs_pool_engine_maps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert HUGE_TMPFS_DIR is not None
    monkeypatch.setattr(pool_mod, "hugepages_free_nbytes", lambda: 0)
    pool = ShmPool.create(PREFIX, NBYTES, HUGE_TMPFS_DIR, backing="tmpfs_huge")
    assert pool.backing is PoolBacking.TMPFS_HUGE and pool.page_nbytes == HUGE_PAGE_NBYTES
    _round_trip(pool)
    pool.close()


def test_forced_backings_fail_clearly_where_not_offered(tmp_path: Path) -> None:
    plain = tmp_path  # a directory on the root filesystem: neither hugetlbfs nor tmpfs
    with pytest.raises(KvdError, match="pool_backing=hugetlbfs: .* not a hugetlbfs mount"):
        ShmPool.create(PREFIX, NBYTES, plain, backing="hugetlbfs")
    with pytest.raises(KvdError, match="pool_backing=tmpfs_huge: .* not a tmpfs mounted"):
        ShmPool.create(PREFIX, NBYTES, plain, backing="tmpfs_huge")
    with pytest.raises(ValueError):
        ShmPool.create(PREFIX, NBYTES, plain, backing="bogus")
    assert os.listdir(plain) == []


# ------------------------------------------------------------------ choice logic, host faked


def _no_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memfd(name: str, flags: int = 0) -> int:
        raise OSError(errno.EINVAL, "hugetlb not configured")

    monkeypatch.setattr(os, "memfd_create", no_memfd)


def test_auto_falls_back_to_4k_shm_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _no_huge_pages(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvd.pool.shm"):
        pool = ShmPool.create(PREFIX, NBYTES, "/dev/shm", backing="auto")
    try:
        if mount_of("/dev/shm").is_huge_tmpfs:  # type: ignore[union-attr]
            assert pool.backing is PoolBacking.TMPFS_HUGE
        else:
            assert pool.backing is PoolBacking.SHM and pool.page_nbytes == 4096
            assert "uses 4 KiB pages" in caplog.text and "memfd_create" in caplog.text
    finally:
        pool.close()


def test_auto_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """hugetlbfs shm_dir > reserved pages via memfd > huge tmpfs > 4 KiB, per pool."""
    made: list[tuple[PoolBacking, Path]] = []
    offered: set[PoolBacking] = set()

    def fake_create(cls: type, backing: PoolBacking, name: str, nbytes: int, directory: Path,
                    forced: bool) -> SimpleNamespace:
        made.append((backing, directory))
        if backing not in offered:
            raise pool_mod._NoPages("not offered")
        return SimpleNamespace(backing=backing, page_nbytes=4096)

    monkeypatch.setattr(ShmPool, "_create", classmethod(fake_create))
    for fstype, options, offer, want in [
        ("hugetlbfs", ("rw",), {PoolBacking.HUGETLBFS, PoolBacking.MEMFD_HUGETLB}, "hugetlbfs"),
        ("hugetlbfs", ("rw",), set(), "shm"),  # out of pages: 4 KiB in the fallback dir
        ("tmpfs", ("huge=always",), {PoolBacking.MEMFD_HUGETLB, PoolBacking.TMPFS_HUGE},
         "memfd_hugetlb"),
        ("tmpfs", ("huge=within_size",), {PoolBacking.TMPFS_HUGE}, "tmpfs_huge"),
        ("tmpfs", ("rw",), {PoolBacking.TMPFS_HUGE}, "shm"),  # not a huge mount: not tried
    ]:
        monkeypatch.setattr(pool_mod, "mount_of",
                            lambda path, f=fstype, o=options: MountInfo("/x", f, o))
        offered = offer | {PoolBacking.SHM}
        made.clear()
        made_pool = ShmPool.create(PREFIX, NBYTES, "/x", backing="auto", fallback_dir=tmp_path)
        assert made_pool.backing.value == want
        if want == "shm" and fstype == "hugetlbfs":
            assert made[-1] == (PoolBacking.SHM, tmp_path)

"""Pool creation, pool side: sizes checked before anything is made,
and any failure while creating leaves no file and no open descriptor behind."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from kvd.errors import KvdError
from kvd.pool.mapping import map_pool
from kvd.pool.shm import PoolBacking, PoolSizeError, ShmPool, kvd_segments

PREFIX = "kvd-createtest"
BLOCK_NBYTES = 2 * 1024 * 1024  # a Llama-3-8B-like block


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.mark.parametrize("nbytes", [2**58 * BLOCK_NBYTES, 2**58, 2**63, 0, -5, 1.5, True])
def test_bad_sizes_refused_before_any_file(pool_dir: Path, nbytes: object) -> None:
    fds = _open_fds()
    with pytest.raises(PoolSizeError) as info:
        ShmPool.create(PREFIX, nbytes, pool_dir)  # type: ignore[arg-type]
    assert info.value.code == "too_large"
    assert os.listdir(pool_dir) == []
    assert _open_fds() == fds


def test_cap_in_the_message(pool_dir: Path) -> None:
    with pytest.raises(PoolSizeError, match="cap of 1048576 bytes"):
        ShmPool.create(PREFIX, 1 << 21, pool_dir, max_nbytes=1 << 20)
    assert os.listdir(pool_dir) == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_fallocate_failure_leaves_no_file(pool_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                          err: int) -> None:
    def fail(fd: int, offset: int, size: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "posix_fallocate", fail)
    fds = _open_fds()
    with pytest.raises(KvdError, match="cannot allocate"):
        ShmPool.create(PREFIX, 1 << 20, pool_dir)
    assert os.listdir(pool_dir) == []
    assert _open_fds() == fds


def test_real_enospc_on_a_full_tmpfs_leaves_no_file() -> None:
    """/dev/shm has room; a pool larger than its size fails in fallocate for real."""
    size = os.statvfs("/dev/shm")
    too_big = size.f_frsize * size.f_blocks + (1 << 30)
    before = kvd_segments(PREFIX)
    with pytest.raises(KvdError, match="cannot allocate"):
        ShmPool.create(PREFIX, too_big, "/dev/shm")
    assert kvd_segments(PREFIX) == before


def test_mmap_failure_leaves_no_file(pool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "no address space")

    monkeypatch.setattr(mmap, "mmap", fail)
    fds = _open_fds()
    with pytest.raises(OSError):
        ShmPool.create(PREFIX, 1 << 20, pool_dir)
    assert os.listdir(pool_dir) == []
    assert _open_fds() == fds


def test_interrupt_during_creation_leaves_no_file(pool_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int, offset: int, size: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "posix_fallocate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ShmPool.create(PREFIX, 1 << 20, pool_dir)
    assert os.listdir(pool_dir) == []


def test_memfd_failure_closes_its_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "no huge pages")

    monkeypatch.setattr(os, "posix_fallocate", fail)
    fds = _open_fds()
    with pytest.raises(KvdError, match="memfd_hugetlb"):
        ShmPool.create(PREFIX, 1 << 20, backing=PoolBacking.MEMFD_HUGETLB)
    assert _open_fds() == fds


def test_default_pool_round_trip(pool_dir: Path) -> None:
    """The default backing is a file in the directory, mapped by path like before."""
    pool = ShmPool.create(PREFIX, 3 << 20, pool_dir)
    assert pool.backing is PoolBacking.SHM and pool.name in os.listdir(pool_dir)
    assert os.path.getsize(pool_dir / pool.name) == 4 << 20  # rounded up to 2 MiB
    pool.array[:3] = [7, 8, 9]
    mapped = map_pool(pool.handle((3 << 20,), "uint8"))
    assert mapped.array[:3].tolist() == [7, 8, 9]
    mapped.close()
    pool.close()
    assert os.listdir(pool_dir) == []


def test_both_pool_kinds_satisfy_the_pool_protocol(tmp_path) -> None:
    """The engine table and registry hold pools only through kvd.pool.base.Pool."""
    from kvd.pool.base import Pool
    from kvd.pool.cuda import CudaPool
    from kvd.pool.shm import ShmPool

    pool = ShmPool.create("kvd-proto", 1 << 16, tmp_path)
    try:
        assert isinstance(pool, Pool) and pool.addr and pool.nbytes >= 1 << 16
    finally:
        pool.close()
    # CudaPool needs a GPU to exist; its class carries every member of the protocol
    for member in ("name", "nbytes", "addr", "handle", "close"):
        assert hasattr(CudaPool, member) or member in CudaPool.__dataclass_fields__, member

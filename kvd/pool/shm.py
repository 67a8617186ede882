"""KV pools that kvd owns and engines map.

NIXL registers only memory owned by the registering process, so the daemon
allocates every engine rank's pool and hands out a handle:

* DRAM: a shared-memory file the engine opens by path and maps (opened directly,
  not through multiprocessing.shared_memory, whose resource tracker unlinks
  segments when an *attaching* process exits). Where its pages come from is the
  pool *backing* (`PoolBacking`): 2 MiB pages when the host offers them, because
  the kernel pins every page of both sides per READ and 4 KiB pages cost ~20-40%
  of a READ's speed here (benchmarks/README.md).
* VRAM: a torch allocation on the rank's device, exported as a CUDA IPC handle
  (kvd.pool.cuda).

This module is the daemon side (`ShmPool`): it creates and removes. The engine
side only maps (`kvd.pool.mapping.map_pool`). Crash leftovers are reaped by owner
lock (`kvd.pool.owner`: `PoolOwner`, `reap_dead_pools`).
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd.errors import KvdError
from kvd.pool.owner import PoolOwner
from kvd.pool.prefault import Prefault
from kvd.wire.protocol import PoolHandle

log = logging.getLogger("kvd.pool.shm")

SHM_DIR = Path("/dev/shm")
SMALL_PAGE_NBYTES = 4096
HUGE_PAGE_NBYTES = 2 * 1024 * 1024
# Far above any real pool, far below what makes fallocate/mmap overflow a C long.
MAX_POOL_NBYTES = 1 << 50


# Mappings are rounded up to 2 MiB so that a huge-page filesystem (hugetlbfs, or
# tmpfs mounted with huge=always) can back the pools; see Config.shm_dir.
MAP_ALIGN = HUGE_PAGE_NBYTES


def mapped_nbytes(nbytes: int, page_nbytes: int = MAP_ALIGN) -> int:
    align = max(page_nbytes, MAP_ALIGN)
    return -(-nbytes // align) * align


class PoolSizeError(KvdError, ValueError):
    """A pool size that is not a positive int or exceeds the cap.

    Carries code ``too_large`` (to be registered in kvd.errors.ERRORS_BY_CODE)."""

    code = "too_large"


class PoolBacking(str, enum.Enum):  # noqa: UP042 - StrEnum would change str(member)
    """Where a DRAM pool's pages come from (Config: ``pool_backing``).

    ``auto`` tries, per pool, in this order: ``hugetlbfs`` if shm_dir is a hugetlbfs
    mount; ``memfd_hugetlb`` if reserved 2 MiB pages are free; ``tmpfs_huge`` if
    shm_dir is a tmpfs mounted ``huge=always|within_size``; else ``shm`` (4 KiB
    pages on a plain tmpfs) with a warning. A forced value fails pool creation when
    the host cannot provide it, instead of falling back.
    """

    AUTO = "auto"
    HUGETLBFS = "hugetlbfs"  # a file in shm_dir, a hugetlbfs mount (reserved huge pages)
    MEMFD_HUGETLB = "memfd_hugetlb"  # memfd_create(MFD_HUGETLB): reserved 2 MiB pages, no
    # mount needed; engines open /proc/<kvd pid>/fd/<fd> (same PID namespace and uid)
    MEMFD = "memfd"  # memfd_create without huge pages: 4 KiB pages, no file, no mount
    # (never picked by auto); opened like memfd_hugetlb
    TMPFS_HUGE = "tmpfs_huge"  # a file in shm_dir, a tmpfs mounted huge=always|within_size
    SHM = "shm"  # a file in shm_dir as it is (4 KiB pages on a plain /dev/shm): no checks


@dataclass(frozen=True)
class MountInfo:
    path: str
    fstype: str
    options: tuple[str, ...]

    @property
    def is_hugetlbfs(self) -> bool:
        return self.fstype == "hugetlbfs"

    @property
    def is_huge_tmpfs(self) -> bool:
        return self.fstype == "tmpfs" and bool(
            {"huge=always", "huge=within_size"} & set(self.options))


def mount_of(path: str | Path) -> MountInfo | None:
    """The mount holding ``path`` (longest mount point prefix in /proc/mounts)."""
    real = os.path.realpath(path)
    best: MountInfo | None = None
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (
                best is None or len(mnt) >= len(best.path)):
            best = MountInfo(mnt, parts[2], tuple(parts[3].split(",")))
    return best


def hugepages_free_nbytes() -> int:
    """Reserved 2 MiB pages free for new hugetlb mappings (HugePages_Free - Rsvd)."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key.startswith("HugePages_"):
                info[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return 0
    free = info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)
    return max(0, free) * HUGE_PAGE_NBYTES


def page_nbytes_of_dir(directory: Path, mount: MountInfo | None) -> int:
    """Page size a pool file in ``directory`` gets (tmpfs huge: what is asked for)."""
    if mount is not None and mount.is_hugetlbfs:
        return os.statvfs(directory).f_bsize  # hugetlbfs reports its page size here
    if mount is not None and mount.is_huge_tmpfs:
        return HUGE_PAGE_NBYTES  # transparent: the kernel's best effort (see page_stats)
    return SMALL_PAGE_NBYTES


def check_nbytes(nbytes: object, max_nbytes: int | None) -> int:
    cap = MAX_POOL_NBYTES if max_nbytes is None else min(max_nbytes, MAX_POOL_NBYTES)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise PoolSizeError(f"pool size must be an int, got {type(nbytes).__name__}")
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise PoolSizeError(f"pool size must be > 0 bytes, got {nbytes}")
    if nbytes > cap:
        raise PoolSizeError(f"pool of {nbytes} bytes exceeds the cap of {cap} bytes")
    return nbytes


class _NoPages(Exception):
    """This backing cannot provide the pool here (auto mode tries the next one)."""




# ---------------------------------------------------------------- pools


@dataclass
class ShmPool:
    """A daemon-owned shared-memory region; ``addr`` is what NIXL registers.

    ``directory``/``name`` is the path engines open: a file, or for a memfd pool
    ``/proc/<pid>/fd``/``<fd>``. ``page_nbytes``: the page size backing it (for
    ``tmpfs_huge`` the size asked of the kernel, which may fall back to 4 KiB pages
    under fragmentation; `page_stats` tells what was mapped).
    """

    name: str
    nbytes: int
    mm: mmap.mmap
    array: np.ndarray  # uint8 view keeping the mapping's address stable
    directory: Path = SHM_DIR
    backing: PoolBacking = PoolBacking.SHM
    page_nbytes: int = SMALL_PAGE_NBYTES
    fd: int | None = None  # memfd pools: kept open for the pool's lifetime
    adopted_from: str | None = None  # adopted file pools: the name the engine knows
    prefault: Prefault | None = None  # its pages being mapped ahead of traffic

    def prefault_in_background(self) -> Prefault:
        """Map every page of the pool in this process on a thread, ahead of the
        copies that would fault them in one by one (kvd.pool.prefault)."""
        if self.prefault is None:
            self.prefault = Prefault(self.addr, len(self.mm), self.name).start()
        return self.prefault

    @property
    def addr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def huge_pages(self) -> bool:
        return self.page_nbytes >= HUGE_PAGE_NBYTES

    @classmethod
    def create(cls, prefix: str, nbytes: int, directory: str | Path = SHM_DIR,
               backing: PoolBacking | str = PoolBacking.SHM, owner: PoolOwner | None = None,
               max_nbytes: int | None = None, fallback_dir: str | Path = SHM_DIR) -> ShmPool:
        """Allocate a pool of ``nbytes`` (mapping rounded up to the page size).

        ``backing``: see PoolBacking (default ``shm``: a file in ``directory``, as kvd
        always did). ``owner``: name the file after this incarnation so that
        `reap_dead_pools` can remove it after a crash. ``fallback_dir``: where ``auto``
        puts a 4 KiB pool when ``directory`` is a hugetlbfs mount out of pages.
        Any failure leaves nothing behind (no file, no fd, no mapping).
        """
        nbytes = check_nbytes(nbytes, max_nbytes)
        directory = Path(directory)
        backing = PoolBacking(backing)
        name = owner.pool_name() if owner is not None else (
            f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}")
        if backing is not PoolBacking.AUTO:
            return cls._create(backing, name, nbytes, directory, forced=True)
        mount = mount_of(directory)
        tried: list[str] = []
        candidates: list[tuple[PoolBacking, Path]] = []
        if mount is not None and mount.is_hugetlbfs:
            candidates.append((PoolBacking.HUGETLBFS, directory))
        candidates.append((PoolBacking.MEMFD_HUGETLB, directory))
        if mount is not None and mount.is_huge_tmpfs:
            candidates.append((PoolBacking.TMPFS_HUGE, directory))
        small_dir = Path(fallback_dir) if mount is not None and mount.is_hugetlbfs else directory
        candidates.append((PoolBacking.SHM, small_dir))
        for choice, where in candidates:
            try:
                pool = cls._create(choice, name, nbytes, where, forced=False)
            except _NoPages as exc:
                tried.append(f"{choice.value}: {exc}")
                continue
            if choice is PoolBacking.SHM and pool.page_nbytes < HUGE_PAGE_NBYTES:
                log.warning("pool %s (%d bytes) uses 4 KiB pages (%s); READs are ~20-40%% "
                            "slower than on huge pages: reserve huge pages or mount a "
                            "huge-page shm_dir (docs/operations.md)", name, nbytes,
                            "; ".join(tried) or "no huge pages offered")
            return pool
        raise KvdError(f"cannot allocate a {nbytes}-byte pool: {'; '.join(tried)}")

    @classmethod
    def _create(cls, backing: PoolBacking, name: str, nbytes: int, directory: Path,
                forced: bool) -> ShmPool:
        """One backing; raises _NoPages when not forced and the host cannot provide it."""

        def unavailable(why: str) -> Exception:
            if forced:
                return KvdError(f"pool_backing={backing.value}: {why}")
            return _NoPages(why)

        if backing in (PoolBacking.MEMFD_HUGETLB, PoolBacking.MEMFD):
            return cls._create_memfd(name, nbytes, unavailable,
                                     huge=backing is PoolBacking.MEMFD_HUGETLB)
        mount = mount_of(directory)
        if backing is PoolBacking.HUGETLBFS and not (mount and mount.is_hugetlbfs):
            raise unavailable(f"{directory} is not a hugetlbfs mount")
        if backing is PoolBacking.TMPFS_HUGE and not (mount and mount.is_huge_tmpfs):
            raise unavailable(f"{directory} is not a tmpfs mounted huge=always|within_size")
        page = page_nbytes_of_dir(directory, mount)
        size = mapped_nbytes(nbytes, page)
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _reserve(fd, size, directory, unavailable if mount and mount.is_hugetlbfs else None)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:  # anything at all: the half-made file goes
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        array = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
        return cls(name=name, nbytes=nbytes, mm=mm, array=array, directory=directory,
                   backing=backing, page_nbytes=page)

    @classmethod
    def _create_memfd(cls, name: str, nbytes: int, unavailable: Any, huge: bool) -> ShmPool:
        flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB | getattr(os, "MFD_HUGE_2MB", 21 << 26)
                                  if huge else 0)
        try:
            fd = os.memfd_create(name, flags)
        except (OSError, AttributeError) as exc:
            what = "memfd_create(MFD_HUGETLB)" if huge else "memfd_create"
            raise unavailable(f"{what} failed: {exc}") from None
        size = mapped_nbytes(nbytes, HUGE_PAGE_NBYTES)
        try:
            _reserve(fd, size, Path("memfd"), unavailable if huge else None)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        array = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
        return cls(name=str(fd), nbytes=nbytes, mm=mm, array=array,
                   directory=Path(f"/proc/{os.getpid()}/fd"),
                   backing=PoolBacking.MEMFD_HUGETLB if huge else PoolBacking.MEMFD,
                   page_nbytes=HUGE_PAGE_NBYTES if huge else SMALL_PAGE_NBYTES, fd=fd)

    def handle(self, shape: tuple[int, ...], dtype: str) -> PoolHandle:
        return PoolHandle(kind="shm", name=self.name, nbytes=self.nbytes, shape=list(shape),
                          dtype=dtype, directory=str(self.directory))

    def give_back(self) -> None:
        """Undo an adoption the daemon could not complete (e.g. NIXL registration
        failed): unmap, and put the file back under the name the engine knows, so the
        engine keeps its memory and may ask again. Any other pool is closed."""
        if self.adopted_from is None or self.fd is not None:
            self.close()  # a memfd stays the engine's: closing drops only kvd's fd
            return
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass
        try:
            os.rename(self.directory / self.name, self.directory / self.adopted_from)
        except OSError as exc:
            log.warning("cannot give pool %s back as %s: %s", self.name, self.adopted_from,
                        exc)

    def close(self) -> None:
        """Unmap and remove. Only call once no READ can touch the region any more."""
        if self.prefault is not None:  # not past the mapping's end
            self.prefault.stop()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping dies with the process
        if self.fd is not None:  # memfd: gone with the last fd and mapping
            os.close(self.fd)
            self.fd = None
            return
        try:
            os.unlink(self.directory / self.name)
        except FileNotFoundError:
            pass


def _reserve(fd: int, size: int, where: Path, no_pages: Any) -> None:
    """Allocate every page now, so that a short pool fails here and not as a SIGBUS
    on an engine's first write. ``no_pages``: how to report ENOSPC/ENOMEM on huge
    pages (auto mode moves on to the next backing); None: a plain KvdError."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OverflowError:
        raise PoolSizeError(f"pool of {size} bytes is too large for this system") from None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL) and no_pages is None:
            os.ftruncate(fd, size)  # filesystems without fallocate
            return
        if no_pages is not None and exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EINVAL,
                                                  errno.EOPNOTSUPP):
            raise no_pages(f"no room for {size} bytes of huge pages "
                           f"({hugepages_free_nbytes()} bytes free): {exc.strerror}") from None
        raise KvdError(f"cannot allocate {size} bytes in {where} ({exc.strerror}); "
                       "is it large enough?") from None


def kvd_segments(prefix: str, directory: str | Path = SHM_DIR) -> list[str]:
    """Pool files carrying our prefix (leak checks, cleanup tooling); owner locks excluded."""
    return sorted(p.name for p in Path(directory).glob(f"{prefix}-*")
                  if not p.name.endswith(".lock"))


def page_stats(addr: int, nbytes: int) -> dict[str, int]:
    """What backs [addr, addr + nbytes) in this process right now, from /proc/self/smaps:
    kB totals of Rss and of the huge-page fields (AnonHugePages, ShmemPmdMapped,
    FilePmdMapped, Private_Hugetlb, Shared_Hugetlb) plus KernelPageSize (kB) of the
    mappings. For reports: tmpfs huge pages are best effort, this says what was given."""
    keys = ("Rss", "AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb",
            "Private_Hugetlb")
    out = dict.fromkeys(keys, 0)
    out["KernelPageSize"] = 0
    end = addr + nbytes
    inside = False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and addr < hi
            continue
        if inside:
            key, _, rest = line.partition(":")
            if key in out:
                value = int(rest.split()[0])
                out[key] = max(out[key], value) if key == "KernelPageSize" else out[key] + value
    return out

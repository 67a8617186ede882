"""Taking over a pool a live engine kept across a daemon restart: a file in shm_dir
(``adopt_file``) or a memfd (``adopt_memfd``).

A memfd pool has no name in any directory: it lives as long as some process holds an
fd or a mapping of it. The daemon that made it is gone; the engine still holds one
(``MappedPool.lock_fd``, from opening ``/proc/<kvd pid>/fd/<n>``). The engine hands it
back the way it received it: its adoption request names ``/proc/<engine pid>/fd/<its
fd>`` (``MappedPool.adoption_handle``), and the new daemon opens that. This needs what
a memfd pool already needs (the engine in kvd's PID namespace, as kvd's uid), and no
socket of its own; SCM_RIGHTS over a unix socket would need the same uid and a second
endpoint to secure.

What is checked, each refused with one line: the path is a process's fd directory
(not this daemon's own pool), the fd is a memfd named after an incarnation of this
daemon's prefix that is dead (``owner_alive``), of the size this geometry maps, not
already a pool here.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvd.errors import InvalidRequestError
from kvd.pool.owner import PoolOwner, owner_alive, owner_of, reap_dead_pools
from kvd.pool.shm import (
    HUGE_PAGE_NBYTES,
    SMALL_PAGE_NBYTES,
    PoolBacking,
    ShmPool,
    check_nbytes,
    mapped_nbytes,
    mount_of,
    page_nbytes_of_dir,
)

log = logging.getLogger("kvd.pool.adopt")

_PROC_FD = re.compile(r"^/proc/(\d+)/fd$")
_MEMFD_LINK = re.compile(r"^/memfd:(.*) \(deleted\)$")


def is_memfd_handle(directory: str) -> bool:
    """A pool handle naming a process's fd (a memfd pool), not a file in a directory."""
    return _PROC_FD.match(directory.rstrip("/")) is not None


def file_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def adopt_memfd(directory: str, name: str, nbytes: int, owner: PoolOwner,
                taken: Iterable[tuple[int, int]] = (),
                max_nbytes: int | None = None) -> ShmPool:
    """Open ``directory``/``name`` (``/proc/<pid>/fd/<n>`` of the engine) and take the
    memfd behind it over; ``taken``: (st_dev, st_ino) of the pools registered here.
    Raises InvalidRequestError saying why not (module docstring)."""
    nbytes = check_nbytes(nbytes, max_nbytes)

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"cannot adopt memfd pool {directory}/{name}: {why}")

    m = _PROC_FD.match(directory.rstrip("/"))
    if m is None or not name.isdigit():
        raise refuse("not /proc/<pid>/fd/<n>")
    if int(m.group(1)) == os.getpid():
        raise refuse("that is this daemon's own fd")
    path = Path(directory) / name
    try:
        link = os.readlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise refuse(f"{exc.strerror} (the engine must run in kvd's PID namespace as "
                     "kvd's uid, as for any memfd pool)") from None
    try:
        memfd = _MEMFD_LINK.match(link)
        st = os.fstat(fd)
        if memfd is None or not stat.S_ISREG(st.st_mode):
            raise refuse(f"it is {link!r}, not a memfd")
        old_owner = owner_of(memfd.group(1), owner.prefix)
        if old_owner is None:
            raise refuse(f"memfd {memfd.group(1)!r} is not a pool of prefix {owner.prefix}")
        if old_owner == owner.owner_id or owner_alive(owner.directory, owner.prefix,
                                                      old_owner):
            raise refuse("its daemon incarnation is alive (it is not a leftover)")
        if (st.st_dev, st.st_ino) in set(taken):
            raise refuse("already registered here")
        huge = st.st_blksize >= HUGE_PAGE_NBYTES
        page = HUGE_PAGE_NBYTES if huge else SMALL_PAGE_NBYTES
        size = mapped_nbytes(nbytes, page)
        if st.st_size != size:
            raise refuse(f"it holds {st.st_size} bytes; this geometry maps {size}")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    array = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    log.info("adopted memfd pool %s (%d bytes) from %s as fd %d: an engine kept it across "
             "a daemon restart", memfd.group(1), nbytes, path, fd)
    return ShmPool(name=str(fd), nbytes=nbytes, mm=mm, array=array,
                   directory=Path(f"/proc/{os.getpid()}/fd"),
                   backing=PoolBacking.MEMFD_HUGETLB if huge else PoolBacking.MEMFD,
                   page_nbytes=page, fd=fd)


def adopt_file(name: str, nbytes: int, directory: str | Path, owner: PoolOwner,
               max_nbytes: int | None = None) -> ShmPool:
    """Take over a pool file a dead incarnation created and a live engine still maps.

    Strict, because the engine asks for it by name: ``name`` must be a pool of this
    prefix in ``directory`` (the daemon's shm_dir), a regular file of ours, of the
    size ``nbytes`` maps to there, whose owner incarnation is dead. The file is
    renamed into ``owner``'s namespace (the engine's mapping follows the inode, and
    the next crash's reaping finds it under the new owner); the bytes never move.
    Raises InvalidRequestError with one line saying why otherwise.
    """
    nbytes = check_nbytes(nbytes, max_nbytes)
    directory = Path(directory)

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"cannot adopt pool {name!r}: {why}")

    if directory.name == "fd" and directory.parent.parent == Path("/proc"):
        raise refuse("a memfd pool: adopt it with kvd.pool.adopt.adopt_memfd")
    old_owner = owner_of(name, owner.prefix)
    if old_owner is None:
        raise refuse(f"not a pool file named {owner.prefix}-<owner>-<token>")
    if old_owner == owner.owner_id or owner_alive(directory, owner.prefix, old_owner):
        raise refuse("its daemon incarnation is alive (it is not a leftover)")
    path = directory / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise refuse(f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        mount = mount_of(directory)
        page = page_nbytes_of_dir(directory, mount)
        size = mapped_nbytes(nbytes, page)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise refuse("not a regular file owned by this daemon's uid")
        if st.st_size != size:
            raise refuse(f"it holds {st.st_size} bytes; this geometry maps {size}")
        new_name = owner.pool_name()
        try:
            os.rename(path, directory / new_name)
        except OSError as exc:
            raise refuse(f"{exc.strerror} (taken by another daemon?)") from None
        if os.stat(directory / new_name).st_ino != st.st_ino:
            raise refuse("the file changed while it was being adopted")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    backing = (PoolBacking.HUGETLBFS if mount is not None and mount.is_hugetlbfs
               else PoolBacking.TMPFS_HUGE if mount is not None and mount.is_huge_tmpfs
               else PoolBacking.SHM)
    array = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    reap_dead_pools(directory, owner.prefix)  # the old owner's lock, if nothing is left
    log.info("adopted pool %s as %s (%d bytes): an engine kept it across a daemon "
             "restart", name, new_name, nbytes)
    return ShmPool(name=new_name, nbytes=nbytes, mm=mm, array=array, directory=directory,
                   backing=backing, page_nbytes=page, adopted_from=name)

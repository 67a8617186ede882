"""Taking over a memfd pool a live engine kept across a daemon restart.

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
already a pool here. Files in ``shm_dir`` are adopted by ``ShmPool.adopt``.
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
from kvd.pool.owner import PoolOwner, owner_alive, owner_of
from kvd.pool.shm import (
    HUGE_PAGE_NBYTES,
    SMALL_PAGE_NBYTES,
    PoolBacking,
    ShmPool,
    check_nbytes,
    mapped_nbytes,
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

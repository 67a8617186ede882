"""Crash-leftover reaping: which daemon incarnation owns which pool files.

After a crash (kill -9) nothing removes a daemon's pool files, so each daemon
incarnation holds an flock on an owner file for its lifetime (`PoolOwner`) and
names its pools after it (`kvd.pool.shm.ShmPool.create(owner=...)`); `reap_dead_pools`
at start removes the files of incarnations whose lock is free (dead), never those
of a live daemon, nor a pool file a live engine still maps: engines hold a shared
flock on every pool file they map (`kvd.pool.mapping.map_pool`), and the reaper
removes only files it can lock exclusively. A pool that survives that way can be
adopted by the next daemon (`kvd.pool.adopt.adopt_file`): the engine keeps its KV
memory across a daemon restart.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kvd.pool.owner")

_OWNER_RE = r"\d+-[0-9a-f]{8}"


@dataclass
class PoolOwner:
    """One daemon incarnation's claim on its pool files: an flock held for its lifetime.

    The lock file ``<prefix>-<owner_id>.lock`` sits in the pool directory and pools are
    named ``<prefix>-<owner_id>-<token>``. The kernel drops the flock when the process
    dies (kill -9 included), which is what proves to `reap_dead_pools` that the files
    are orphans; pid checks cannot (pid reuse, PID namespaces sharing one directory).
    The lock is taken on a temporary name and then renamed into place, so a visible
    lock file is always already locked by its live owner.
    """

    prefix: str
    owner_id: str
    directory: Path
    fd: int | None = field(default=None, repr=False)

    @property
    def lock_path(self) -> Path:
        return self.directory / f"{self.prefix}-{self.owner_id}.lock"

    @classmethod
    def acquire(cls, directory: str | Path, prefix: str) -> PoolOwner:
        directory = Path(directory)
        owner_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        owner = cls(prefix=prefix, owner_id=owner_id, directory=directory)
        tmp = directory / f".{prefix}-{owner_id}.lock.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # empty: hugetlbfs has no write()
            os.rename(tmp, owner.lock_path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        owner.fd = fd
        return owner

    def pool_name(self) -> str:
        return f"{self.prefix}-{self.owner_id}-{secrets.token_hex(6)}"

    def release(self) -> None:
        """Clean shutdown: remove the lock file (pools are closed by their owners)."""
        if self.fd is None:
            return
        self.lock_path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


def owner_of(name: str, prefix: str) -> str | None:
    """The incarnation id a pool file ``<prefix>-<owner_id>-<token>`` is named after."""
    m = re.match(rf"^{re.escape(prefix)}-({_OWNER_RE})-[0-9a-f]{{12}}$", name)
    return m.group(1) if m else None


def owner_alive(directory: str | Path, prefix: str, owner_id: str) -> bool:
    """True while incarnation ``owner_id`` holds its owner lock in ``directory`` (a
    visible lock file is always locked by its live owner until it dies; a dead one's
    is removed by the reaper or free to lock)."""
    try:
        fd = os.open(Path(directory) / f"{prefix}-{owner_id}.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return _locked_against(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def _locked_against(fd: int, mode: int) -> bool:
    """Whether another open file holds an flock on ``fd``'s file that refuses ``mode``
    (LOCK_SH: an exclusive one; LOCK_EX: any); a lock taken to find out is dropped."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


_POOL_STEM_RE = re.compile(rf"^(.+-{_OWNER_RE})-[0-9a-f]{{12}}$")


def owner_lock_name(pool_name: str) -> str | None:
    """The owner lock file's name for a pool file ``<prefix>-<owner_id>-<token>`` (None:
    not a name an owned pool has), without knowing the prefix: a peer's pool names it."""
    m = _POOL_STEM_RE.match(pool_name)
    return f"{m.group(1)}.lock" if m else None


class OwnerWatch:
    """Whether the daemon incarnation that owns a pool file is still the one alive.

    Holds a descriptor of the owner's lock file (opened while its owner was alive) and
    probes it with a shared, non-blocking flock: refused while the owner holds its
    exclusive lock, granted (and dropped at once) once it died or stopped. A new
    incarnation can only exist, adopt the pool and let its engine reuse published blocks
    after the old one died, so "alive after the copy ended" proves the copy read bytes no
    restart could have handed back. The probe never blocks a successor: ``owner_alive``
    and adoption take the same shared lock, and the reaper's exclusive try only skips a
    round."""

    def __init__(self, lock_path: str | Path) -> None:
        self.path = str(lock_path)
        self.fd: int | None = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    def alive(self) -> bool:
        return self.fd is not None and _locked_against(self.fd, fcntl.LOCK_SH)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def mapped_by_another(path: str | Path) -> bool:
    """Whether some process maps this pool file: an engine holds a shared flock on every
    pool file it maps (kvd.pool.mapping.map_pool), so an exclusive try is refused. False
    when the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return _locked_against(fd, fcntl.LOCK_EX)
    except OSError:
        return False  # a filesystem without flock: nobody can be seen mapping it
    finally:
        os.close(fd)


def _unlink_unless_mapped(path: Path) -> bool | None:
    """Remove a pool file unless an engine holds its shared flock (still maps it).
    True: removed; False: kept (in use); None: already gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return True
    finally:
        os.close(fd)


def reap_dead_pools(directory: str | Path, prefix: str,
                    pool_dirs: tuple[str | Path, ...] = ()) -> list[str]:
    """Remove the pool files of dead incarnations; returns the names removed.

    An incarnation is dead when its lock file in ``directory`` can be flocked: the
    kernel released its owner's lock. Its pools ``<prefix>-<owner_id>-*`` are removed
    from ``directory`` and from ``pool_dirs`` (e.g. the 4 KiB fallback directory), then
    the lock file. Live daemons' locks (other processes, or other daemons of this
    process) cannot be taken, so their files are never touched; pool files without an
    owner lock (older kvd versions) are left alone. A pool file a live engine still
    maps (it holds a shared flock on it) is kept, and so is its owner's lock file, so
    that a later reap removes it once the engine is gone, unless a new daemon adopted
    it meanwhile (renaming it into its own incarnation).
    """
    directory = Path(directory)
    lock_re = re.compile(rf"^\.?{re.escape(prefix)}-({_OWNER_RE})\.lock(\.tmp)?$")
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = lock_re.match(entry)
        if m is None:
            continue
        lock_path = directory / entry
        try:
            if m.group(2) and time.time() - lock_path.stat().st_mtime < 60:
                continue  # a daemon starting right now, between creating and locking it
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # reaped by someone else meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            owner, before, kept = m.group(1), len(removed), 0
            pool_re = re.compile(rf"^{re.escape(prefix)}-{re.escape(owner)}-[0-9a-f]{{12}}$")
            for d in (directory, *map(Path, pool_dirs)):
                try:
                    names = os.listdir(d)
                except FileNotFoundError:
                    continue
                for name in sorted(names):
                    if pool_re.match(name):
                        gone = _unlink_unless_mapped(d / name)
                        if gone:
                            removed.append(name)
                        elif gone is False:
                            kept += 1
            if kept:
                log.warning("kept %d pool file(s) of dead kvd incarnation %s in %s: live "
                            "engines still map them (a new daemon can adopt them)",
                            kept, owner, directory)
            else:
                lock_path.unlink(missing_ok=True)  # (a .tmp: died before renaming it)
            if len(removed) > before:
                log.warning("removed %d pool file(s) of dead kvd incarnation %s in %s",
                            len(removed) - before, owner, directory)
        finally:
            os.close(fd)
    return removed

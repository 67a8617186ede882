"""Engines whose every connection closed are gone at once, not engine_timeout_s later.

A stopped or killed engine closes its sockets (the kernel does it for a kill -9), and
ZMQ's monitor reports ``DISCONNECTED`` with the file descriptor, never the identity.
So each identity that speaks for an engine is remembered with the descriptor its
messages came over and a key of the connection on it: the peer's (address, port) for
tcp, the peer's pid (``SO_PEERCRED``) for ipc. When a descriptor closes, an identity
whose descriptor now holds another connection, or none, is gone; an engine left with
no identity is retired. The key is what makes a reused descriptor safe: the kernel
hands a closed descriptor's number to the next connection at once.

Conservative by design: an identity whose key cannot be read is never tracked (the
engine then goes after engine_timeout_s, as before), and an ipc connection replaced by
another from the same process is kept until the timeout. A client that closes its only
socket and opens a new one (``KvdClient`` after a timed-out call) is retired when the
old one closes if the new one has not spoken yet; its next call is refused
``not_found`` and the engine registers again.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

_UCRED = struct.Struct("3i")  # pid, uid, gid


def connection_key(fd: int) -> Hashable | None:
    """Who is on the other end of ``fd`` now; None when it is closed or not a socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        if sock.family == socket.AF_UNIX:
            pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _UCRED.size))
            return ("unix", pid) if pid > 0 else None
        return (int(sock.family), sock.getpeername())
    except OSError:
        return None
    finally:
        sock.close()  # the duplicate only


@dataclass
class _Conn:
    fd: int
    key: Hashable
    engines: set[str] = field(default_factory=set)


class ConnectionTracker:
    """Which identities speak for which engine, and over which connection."""

    def __init__(self, key_of: Callable[[int], Hashable | None] = connection_key) -> None:
        self._key_of = key_of
        self._conns: dict[bytes, _Conn] = {}
        self._by_engine: dict[str, set[bytes]] = {}

    def note(self, identity: bytes, fd: int, engine_id: str) -> None:
        """``identity`` sent a message for ``engine_id`` over descriptor ``fd``."""
        conn = self._conns.get(identity)
        if conn is None:
            key = self._key_of(fd) if fd >= 0 else None
            if key is None:
                return
            conn = self._conns[identity] = _Conn(fd, key)
        if engine_id not in conn.engines:
            conn.engines.add(engine_id)
            self._by_engine.setdefault(engine_id, set()).add(identity)

    def closed(self, fd: int) -> list[str]:
        """A connection on ``fd`` closed: the engines left with no open connection."""
        gone: list[str] = []
        current = self._key_of(fd)
        for identity, conn in list(self._conns.items()):
            if conn.fd != fd or conn.key == current:
                continue
            del self._conns[identity]
            for engine_id in conn.engines:
                left = self._by_engine.get(engine_id)
                if left is None:
                    continue
                left.discard(identity)
                if not left:
                    del self._by_engine[engine_id]
                    gone.append(engine_id)
        return gone

    def forget(self, engine_id: str) -> None:
        """The engine is gone by other means (deregistered, timed out)."""
        for identity in self._by_engine.pop(engine_id, set()):
            conn = self._conns.get(identity)
            if conn is not None:
                conn.engines.discard(engine_id)
                if not conn.engines:
                    del self._conns[identity]

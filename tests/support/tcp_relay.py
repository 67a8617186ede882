"""A recording TCP relay on loopback: what a daemon would see on the wire between two.

A consumer daemon is told to pull from the relay's address; the relay forwards every
connection to the real peer face and keeps the bytes of each direction, so a test can
look for secrets in them and replay a captured client stream.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

MAX_RECORDED_BYTES = 64 << 20


@dataclass
class Conn:
    up: bytearray = field(default_factory=bytearray)  # client -> server
    down: bytearray = field(default_factory=bytearray)  # server -> client


class TcpRelay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.conns: list[Conn] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def recorded(self) -> bytes:
        with self._lock:
            return b"".join(bytes(c.up) + bytes(c.down) for c in self.conns)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            conn = Conn()
            with self._lock:
                self.conns.append(conn)
                self._socks += [client, server]
            for a, b, buf in ((client, server, conn.up), (server, client, conn.down)):
                threading.Thread(target=self._pump, args=(a, b, buf), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, buf: bytearray) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            with self._lock:
                if len(buf) < MAX_RECORDED_BYTES:
                    buf += data
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()


def replay(target: tuple[str, int], stream: bytes, wait_s: float = 2.0) -> tuple[bytes, bool]:
    """Send a captured client stream to ``target`` on a fresh connection, in one go;
    (what came back within ``wait_s``, whether the server closed the connection)."""
    got = bytearray()
    with socket.create_connection(target, timeout=wait_s) as s:
        with contextlib.suppress(OSError):
            s.sendall(stream)
        s.settimeout(wait_s)
        while True:
            try:
                data = s.recv(65536)
            except TimeoutError:
                return bytes(got), False
            except OSError:  # reset
                return bytes(got), True
            if not data:
                return bytes(got), True
            got += data

"""The engine face's direct door: the same requests over a Unix stream socket, abstract
or beside an ipc:// face's path (kvd.wire.stream says why, where and how they are
framed).

Each connection is served like a ZMQ connection of the engine face: in arrival order,
each message answered by the face's own `answer` (header first, the token checked in
constant time before the body is decoded, exactly one reply), yielding the loop every
``SERVE_SLICE_S``. Replies sent later (a parked Poll, a registration) find their
connection through `Face.send`, by an identity no ZMQ peer can have (ZMQ refuses
routing ids that start with a zero byte and makes its own 5 bytes long).

Bounds: a length over the face's limits closes the connection (the stream is out of
step; counted as a protocol error); a connection stops being read while
``receive_queue_bytes`` of its messages wait; a reply to a client that does not read
(``max_message_bytes`` already buffered toward it) is dropped, as a ZMQ ROUTER drops
past its high-water mark (acknowledged polls make events survive that).

Liveness: direct connections are not tracked by kvd.daemon.engines.liveness (their
requests carry no descriptor): an engine is retired when its ZMQ connections close, or
after engine_timeout_s, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kvd.errors import ProtocolError
from kvd.ops.metrics import Metrics
from kvd.wire import protocol as P
from kvd.wire import stream as S

log = logging.getLogger("kvd.daemon")

LISTEN_BACKLOG = 128
SERVE_SLICE_S = 0.002  # as the ZMQ face: the longest run of answers before a yield
IDENTITY_PREFIX = b"\0kvd-direct-"


Handlers = dict[type, Callable[[Any, Any], Awaitable[Any]]]


class Answering(Protocol):
    """What the door needs of its face (kvd.daemon.faces.Face)."""

    name: str
    instance_id: str
    metrics: Metrics

    async def answer(self, payload: list[Any], identity: bytes, handlers: Handlers,
                     fd: int = -1) -> tuple[Any, int]: ...


class DirectFace:
    """Listens on one abstract name and serves its connections with ``face``'s handlers."""

    def __init__(self, face: Answering, name: str, max_message_bytes: int,
                 receive_queue_bytes: int) -> None:
        self.face = face
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.receive_queue_bytes = receive_queue_bytes
        self.conns: dict[bytes, _Conn] = {}
        self._ids = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._handlers: Handlers = {}
        self._poller: select.poll | None = None  # the connections' descriptors (`waiting`)
        self._path = None if S.is_abstract(name) else name  # a file to remove at close
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(S.address_of(name))
            self.sock.listen(LISTEN_BACKLOG)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)

    async def serve(self, handlers: Handlers) -> None:
        self._handlers = handlers
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Conn(self), sock=self.sock)
        await self._server.serve_forever()

    def send(self, identity: bytes, msg_id: int, body: Any) -> bool:
        """Reply on the direct connection ``identity``; False if it is not one of ours
        (a ZMQ identity: the caller sends it there)."""
        conn = self.conns.get(identity)
        if conn is None:
            return identity.startswith(IDENTITY_PREFIX)  # closed meanwhile: dropped
        conn.write(P.encode(body, msg_id, instance=self.face.instance_id))
        return True

    def waiting(self) -> bool:
        """Whether a request has come on some connection and is not yet answered: read
        and queued, or still in the kernel's buffer (as the ZMQ face's Inbox counts what
        its I/O thread has taken)."""
        if any(conn.pending for conn in self.conns.values()):
            return True
        if self._poller is None:
            self._poller = select.poll()
            for conn in self.conns.values():
                if conn.fd >= 0:
                    self._poller.register(conn.fd, select.POLLIN)
        return bool(self._poller.poll(0))

    def _changed(self) -> None:
        self._poller = None  # rebuilt for the connections now open

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.conns.values()):
            conn.abort()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None


class _Conn(asyncio.Protocol):
    """One engine's connection: reads into frames, answers them in order on a task."""

    def __init__(self, door: DirectFace) -> None:
        self.door = door
        self.identity = IDENTITY_PREFIX + str(next(door._ids)).encode()
        self.reader = S.FrameReader(P.MAX_HEADER_BYTES, door.max_message_bytes)
        self.pending: deque[tuple[bytes, bytes]] = deque()
        self.pending_bytes = 0
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self._paused = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        self.door.conns[self.identity] = self
        self.door._changed()
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except ProtocolError as exc:
            self.door.face.metrics.protocol_error(self.door.face.name, exc.reason)
            log.warning("direct engine connection closed: %s", exc)
            self.abort()
            return
        for frame in frames:
            self.pending.append(frame)
            self.pending_bytes += len(frame[0]) + len(frame[1])
        if frames:
            self._wake.set()
        if (self.pending_bytes + self.reader.buffered >= self.door.receive_queue_bytes
                and not self._paused and self.transport is not None):
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.door.conns.pop(self.identity, None)
        self.door._changed()
        self.pending.clear()
        if self._task is not None:
            self._task.cancel()

    def write(self, frames: list[bytes]) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size() >= self.door.max_message_bytes:
            log.debug("reply dropped: the direct client is not reading")
            return
        t.write(S.pack(frames))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def _serve(self) -> None:
        face = self.door.face
        slice_end_s = time.perf_counter() + SERVE_SLICE_S
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            header, body = self.pending.popleft()
            self.pending_bytes -= len(header) + len(body)
            if self._paused and self.pending_bytes < self.door.receive_queue_bytes // 2:
                self._paused = False
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.resume_reading()
            reply, msg_id = await face.answer([header, body], self.identity,
                                               self.door._handlers)
            if reply is not None:
                self.write(P.encode(reply, msg_id, instance=face.instance_id))
            if time.perf_counter() >= slice_end_s:
                await asyncio.sleep(0)
                slice_end_s = time.perf_counter() + SERVE_SLICE_S

"""A face: one ZMQ ROUTER socket, its receive bound, and the loop that answers it.

Per message: decode the header alone (kvd.wire.codec), check the token in constant time,
decode the body only then, call the handler for its type, and send exactly one
reply, an ``Error`` carrying the request id (read even from a header that does not
decode) when anything fails. Nothing a sender does stops the loop: a handler bug is
answered ``internal`` and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from kvd.daemon.curve_auth import CurveGuard, monitor_events, parse_event
from kvd.errors import AuthError, BusyError, InternalError, KvdError, ProtocolError
from kvd.ops.metrics import Metrics
from kvd.ops.trace import TRACE
from kvd.wire import protocol as P
from kvd.wire.stream import is_loopback_host

if TYPE_CHECKING:
    from kvd.daemon.direct import DirectFace

log = logging.getLogger("kvd.daemon")

MIN_RECEIVE_HWM = 8  # messages queued per connection, at the least
SERVE_SLICE_S = 0.002
REBIND_TIMEOUT_S = 2.0  # a face re-bound with a new CURVE key waits this for its address
REBIND_RETRY_S = 0.005  # longest run of requests answered before the face yields the loop


@dataclass(frozen=True)
class Request:
    identity: bytes
    header: P.Header
    fd: int = -1  # the connection's descriptor (ZMQ's "__fd"), for kvd.daemon.engines.liveness


Handler = Callable[[Any, Request], Awaitable[Any]]


def claim_ipc_path(path: str) -> None:
    """Make an ipc:// path bindable: remove a crashed daemon's socket file, refuse a live one.

    libzmq unlinks whatever file is at the path before binding, which would silently take
    the address from a daemon still serving there (its engines would then talk to us).
    So: connect first; refused means nobody listens (a stale file, removed here), accepted
    means a live process owns it and we fail like a TCP bind would (EADDRINUSE).
    Abstract addresses (``@name``) leave no file and need nothing.
    """
    if not path or path.startswith("@") or not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale ipc socket %s (nobody listens)", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        except OSError as exc:  # not a socket, no permission: let bind report it
            log.debug("ipc path %s not probed: %s", path, exc)
            return
    raise OSError(errno.EADDRINUSE, f"ipc://{path} is in use by a running process", path)


def _host(endpoint: str) -> str:
    return endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")


def is_loopback(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):
        return True
    return is_loopback_host(_host(endpoint))


class Inbox:
    """Receives from a plain ZMQ socket on the event loop, without pyzmq's asyncio adapter
    (a future, a flag-enum dance and a loop callback per message: a bare ping-pong took
    157 us with it and 115 us without on a 2-core host;
    docs/notes/2026-11-27-one-block-latency.md).

    ZMQ's descriptor is edge-like: it signals that the socket's events may have changed,
    and any send, receive or EVENTS read on the socket may consume that signal. So a
    receive first takes a waiting message without blocking; only when EVENTS says none
    is there does it wait for the descriptor. Every send on the socket is followed by
    `kick` (it may have consumed the signal of a message that came meanwhile)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def recv(self) -> list[zmq.Frame]:
        sock = self.sock
        while True:
            try:
                return sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                if self._loop is not None:
                    self._loop.remove_reader(self._fd)
                loop.add_reader(self._fd, self.kick)
                self._loop = loop
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def waiting(self) -> bool:
        """Whether a message waits to be received. Reading EVENTS consumes the
        descriptor's signal, so a waiting `recv` is woken here as `kick` would: this
        may be asked from outside the face's own task (a pull's post)."""
        try:
            readable = bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:  # closed meanwhile
            return False
        waiter = self._waiter
        if readable and waiter is not None and not waiter.done():
            waiter.set_result(None)
        return readable

    def kick(self) -> None:
        """Wake a waiting `recv` if a message is there (the loop's reader on the
        descriptor, and every send). Reading EVENTS also consumes the descriptor's signal,
        as pyzmq's own reader does."""
        try:
            readable = self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
        except zmq.ZMQError:  # closed meanwhile
            return
        waiter = self._waiter
        if readable and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None


class Face:
    def __init__(self, ctx: zmq.asyncio.Context, name: str, address: str,
                 allowed: tuple[type, ...], max_message_bytes: int, receive_queue_bytes: int,
                 token: str, instance_id: str, metrics: Metrics,
                 curve: CurveGuard | None = None) -> None:
        self.name = name
        self.address = address
        self.allowed = allowed
        # A CURVE face authenticates connections by key (ZAP, then every message's
        # User-Id): the shared token is neither needed nor checked there.
        self.curve = curve
        self.token = "" if curve is not None else token
        self.instance_id = instance_id
        self.metrics = metrics
        # A plain socket, received from through `Inbox`; made by the (asyncio) context, so
        # that its destroy() closes it too, and the monitor socket it makes is awaited as
        # usual.
        self.sock = ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # Bounded in bytes: at most receive_queue_bytes of messages of the largest allowed
        # size wait per connection (ZMQ counts messages); past it, TCP back-pressure.
        self.sock.setsockopt(zmq.RCVHWM,
                             max(MIN_RECEIVE_HWM, receive_queue_bytes // max_message_bytes))
        # TCP listeners: libzmq sets SO_REUSEADDR itself, so a crashed daemon re-binds at
        # once despite connections left in TIME_WAIT (tests/daemon/test_rebind.py).
        if curve is not None:
            curve.secure(name, self.sock)
        if address.startswith("ipc://"):
            claim_ipc_path(address[len("ipc://"):])
        self.sock.bind(address)
        self.inbox = Inbox(self.sock)
        self.direct: DirectFace | None = None  # the engine face's Unix door (`open_direct`)

    def open_direct(self, name: str, max_message_bytes: int, receive_queue_bytes: int
                    ) -> DirectFace:
        """Also serve this face's requests on the Unix socket ``name`` (``@`` abstract, or
        a path: kvd.wire.stream); the door's own `serve` then answers them."""
        from kvd.daemon.direct import DirectFace
        from kvd.wire.stream import is_abstract

        if not is_abstract(name):
            claim_ipc_path(name)  # a crashed daemon's file goes; a live daemon's stays
        self.direct = DirectFace(self, name, max_message_bytes, receive_queue_bytes)
        return self.direct

    def waiting(self) -> bool:
        """Whether a request waits to be answered, on ZMQ or on the direct door."""
        return self.inbox.waiting() or (self.direct is not None and self.direct.waiting())

    async def rekey(self, keys: Any, timeout_s: float = REBIND_TIMEOUT_S) -> None:
        """Serve new connections with another CURVE keypair: libzmq copies security
        options into a listener at bind, so the listener is bound again (its accepted
        connections close with it and their clients redial: a kvd peer finds the new
        key in its allowlist)."""
        from kvd.wire.curve import server_socket

        assert self.curve is not None
        server_socket(self.sock, keys)
        from kvd.daemon.curve_auth import FACE_DOMAINS

        self.sock.setsockopt(zmq.ZAP_DOMAIN, FACE_DOMAINS[self.name].encode())
        self.sock.unbind(self.address)
        # libzmq closes the old listener on its I/O thread: the address is free a
        # moment later, not at once.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.bind(self.address)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(REBIND_RETRY_S)

    async def serve(self, handlers: dict[type, Handler]) -> None:
        """Answer requests in arrival order (per connection), yielding the loop at least
        every ``SERVE_SLICE_S``: a receive that finds a message waiting does not yield,
        so a burst (1,000 Pulls) would otherwise be taken in one go, and every task it
        spawned would take its first step in one loop turn, holding every other reply
        (Pings and Polls included) for the whole burst."""
        slice_end_s = time.perf_counter() + SERVE_SLICE_S
        while True:
            frames = await self.inbox.recv()
            identity = frames[0].bytes
            if self.curve is not None and not self.curve.check_message(
                    self.name, _user_id(frames), _fd(frames)):
                continue  # a revoked key: its connection is being closed, no answer
            reply, msg_id = await self.answer([f.buffer for f in frames[1:]], identity,
                                              handlers, _fd(frames))
            if reply is not None:
                self.send(identity, msg_id, reply)
            if time.perf_counter() >= slice_end_s:
                await asyncio.sleep(0)  # a turn for the rest of the loop, not a wait
                slice_end_s = time.perf_counter() + SERVE_SLICE_S

    async def answer(self, payload: list[Any], identity: bytes,
                     handlers: dict[type, Handler], fd: int = -1) -> tuple[Any, int]:
        """(reply or None for a long poll answered later, the id to reply with)."""
        msg_id = 0
        try:
            if len(payload) != 2:
                raise ProtocolError(f"expected 2 frames, got {len(payload)}")
            header = P.decode_header(payload[0])
            msg_id = header.id
            if self.token and not hmac.compare_digest(header.token.encode(),
                                                      self.token.encode()):
                self.metrics.auth_failures.labels(face=self.name).inc()
                raise AuthError("bad or missing token")
            body = P.decode_body(header, payload[1], self.allowed)
            if TRACE.on and isinstance(body, (P.Pull, P.Publish, P.Acquire)):
                TRACE.point(f"daemon_{type(body).__name__.lower()}", body.request_id)
            reply = await handlers[type(body)](body, Request(identity, header, fd))
            if TRACE.on and reply is not None and type(body) is P.Acquire:
                TRACE.point("daemon_acquired", body.request_id)
            return reply, msg_id
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the face
            if isinstance(exc, ProtocolError) and not msg_id and payload:
                msg_id = P.peek_id(bytes(payload[0]))  # reply to the right call even so
            return self._error(exc), msg_id

    def _error(self, exc: Exception) -> P.Error:
        """The one reply to a request that failed, counted and logged as its kind asks."""
        if isinstance(exc, ProtocolError):
            self.metrics.protocol_error(self.name, exc.reason)
        elif isinstance(exc, BusyError):
            self.metrics.busy_rejections.inc()
        if isinstance(exc, KvdError):
            return P.Error(code=exc.code, message=str(exc))
        log.exception("handler failed on the %s face", self.name, exc_info=exc)
        return P.Error(code=InternalError.code, message=f"internal error: {exc!r}")

    async def answer_later(self, identity: bytes, msg_id: int, work: Awaitable[Any]) -> None:
        """Reply to one request with ``work``'s result, or its error as `answer` would:
        for a handler that must not hold the face while it waits (a registration: pool
        allocation and NIXL registration, a second or more per GiB). Meanwhile the face
        answers every other request, Pings and Polls included."""
        try:
            reply = await work
        except Exception as exc:  # noqa: BLE001 - as in answer
            reply = self._error(exc)
        self.send(identity, msg_id, reply)

    def send(self, identity: bytes, msg_id: int, body: Any) -> None:
        if self.direct is not None and self.direct.send(identity, msg_id, body):
            return
        try:
            self.sock.send_multipart([identity, *P.encode(body, msg_id,
                                                          instance=self.instance_id)],
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply dropped: %s", exc)
        self.inbox.kick()

    async def watch_disconnects(self, on_closed: Callable[[int], None] | None) -> None:
        """Call ``on_closed(fd)`` for every connection of this face that closes; on a
        CURVE face, also tell the guard of accepted connections and failed handshakes.
        (One monitor per socket: libzmq keeps one.)"""
        monitor = self.sock.get_monitor_socket(monitor_events(self.curve is not None))
        try:
            while True:
                event, value = parse_event(await monitor.recv_multipart())
                if self.curve is not None:
                    self.curve.on_event(self.name, event, value)
                if event == zmq.EVENT_DISCONNECTED and on_closed is not None:
                    on_closed(value)
        finally:
            self.sock.disable_monitor()
            monitor.close(0)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        self.inbox.close()
        self.sock.close(0)


def _user_id(frames: list[Any]) -> str | None:
    """The ZAP User-Id of the connection a message came on (the client's CURVE key)."""
    try:
        return frames[-1].get("User-Id")
    except (zmq.ZMQError, ValueError, TypeError):
        return None


def _fd(frames: list[Any]) -> int:
    try:
        return int(frames[-1].get("__fd"))
    except (zmq.ZMQError, ValueError, TypeError):
        return -1

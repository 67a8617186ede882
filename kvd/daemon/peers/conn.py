"""One connection to another kvd daemon: request/reply over a DEALER, with its identity.

Replies are matched to requests by header id, and every wait is bounded by the
daemon's clock. Every reply header carries the remote daemon's ``instance`` (one
random id per process incarnation): when it changes, or when ZMQ reports the TCP
connection dropped, the connection tells its owner (``on_lost``), which drops
whatever it cached about that daemon (NIXL metadata, pool addresses, epochs).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvd.daemon.clock import Clock
from kvd.daemon.peers.reply import Reply
from kvd.errors import (
    AuthError,
    KvdError,
    KvdTimeoutError,
    PeerLostError,
    ProtocolError,
    error_from_code,
)
from kvd.wire import curve as C
from kvd.wire import protocol as P

log = logging.getLogger("kvd.peers")

RECONNECT_INTERVAL_MS = 100
LOST = "disconnected"  # the reason `on_lost` gets when liveness (or the peer) dropped it
HEARTBEATS_PER_TIMEOUT = 6  # PINGs per liveness timeout (one is 0.5 s at the 3 s default)


def liveness_ms(liveness_timeout_s: float) -> tuple[int, int]:
    """(liveness timeout, ZMTP heartbeat interval) in ms: silence is noticed within
    interval + (timeout - interval) = the liveness timeout."""
    timeout_ms = max(2, int(liveness_timeout_s * 1000))
    return timeout_ms, max(1, timeout_ms // HEARTBEATS_PER_TIMEOUT)


class PeerConnection:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, token: str, instance: str,
                 max_message_bytes: int, clock: Clock,
                 on_lost: Callable[[str, str], None],
                 liveness_timeout_s: float | None = None,
                 curve_keys: C.KeyPair | None = None, server_key: bytes | None = None,
                 candidates: Callable[[], list[bytes]] | None = None,
                 on_key: Callable[[str, bytes], None] | None = None,
                 on_refused: Callable[[str], None] | None = None,
                 discover_timeout_s: float = 5.0,
                 on_up: Callable[[str], None] | None = None) -> None:
        self.address = address
        # With CURVE the connection is authenticated by key: the token is not sent.
        self.token = "" if curve_keys is not None else token
        self.curve = curve_keys is not None
        self.server_key = server_key  # the server's CURVE key (None: not known yet)
        # Set when the security handshake failed (a plaintext peer for a CURVE daemon,
        # a CURVE peer for a plaintext one, a key refused): requests fail at once with
        # it, instead of waiting their timeout on a connection that cannot come up.
        self.refused: KvdError | None = None
        self._on_refused = on_refused
        self._on_up = on_up  # connected again after a drop (not the first connect)
        self._handshaken = False  # the current connection completed its ZMTP handshake
        self.clock = clock
        self.own_instance = instance
        self.remote_instance = ""  # learnt from the first reply
        self.connected: bool | None = None  # None: never connected yet
        self.lost_s: float | None = None  # when it last disconnected, on the daemon clock
        self._up = asyncio.Event()  # set while connected
        self._on_lost = on_lost
        self._liveness_s = liveness_timeout_s
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
        if liveness_timeout_s is not None:
            # ZMTP heartbeats: a peer silent for liveness_timeout_s (partition, dead host,
            # frozen process) drops the connection (-> disconnected -> cached handshakes
            # dropped, its pulls failed, their READs severed) and ZMQ dials a fresh one,
            # so after a heal nothing half-dead is reused. ZMQ arms HEARTBEAT_TIMEOUT when
            # it sends a PING, up to one interval after the silence began: the two add up
            # to the liveness timeout (IVL + TIMEOUT each was 1 s + 3 s = 4 s before).
            timeout_ms, ivl_ms = liveness_ms(liveness_timeout_s)
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms - ivl_ms)
            self.sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED
                                                     | zmq.EVENT_DISCONNECTED
                                                     | C.HANDSHAKE_EVENTS)
        # The same socket without the asyncio wrapper, for `take_ready` (never waits).
        self._now = zmq.Socket.shadow(self.sock.underlying)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        loop = asyncio.get_running_loop()
        self._discovery: asyncio.Task[None] | None = None
        if curve_keys is None:
            self.sock.connect(address)
        elif server_key is not None:
            C.client_socket(self.sock, curve_keys, server_key)
            self.sock.connect(address)
        else:
            # Requests sent meanwhile wait in pyzmq's send until the socket connects.
            self._discovery = loop.create_task(self._discover(
                ctx, curve_keys, candidates or (lambda: []), on_key, discover_timeout_s))
        self._reader = loop.create_task(self._read())
        self._watcher = loop.create_task(self._watch())

    async def _discover(self, ctx: zmq.asyncio.Context, keys: C.KeyPair,
                        candidates: Callable[[], list[bytes]],
                        on_key: Callable[[str, bytes], None] | None, timeout_s: float) -> None:
        """Find which allowlisted key the server holds, then connect with it."""
        try:
            key = await C.discover_server_key(ctx, self.address, keys, candidates(), timeout_s)
            if key is None:  # no other key fits: a peer sharing this daemon's keypair?
                key = await C.discover_server_key(ctx, self.address, keys, [keys.public],
                                                  timeout_s)
            if key is None:
                raise AuthError(f"peer {self.address}: no key of the allowlist is its key "
                                "(its CURVE handshake failed with every one)")
        except KvdError as exc:
            log.warning("peer %s: %s", self.address, exc, extra={"peer": self.address})
            self.refused = exc
            self._fail_waiting(exc)
            if self._on_refused is not None:
                self._on_refused(self.address)
            return
        self.server_key = key
        C.client_socket(self.sock, keys, key)
        self.sock.connect(self.address)
        if on_key is not None:
            on_key(self.address, key)

    async def _read(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._on_reply(frames)

    def take_ready(self) -> int:
        """Take the replies already queued on the socket now, without a loop turn.

        A caller that kept the event loop busy (an inline READ) finds its Acquire's reply
        here at once, instead of one to two loop turns later through the reader task
        (~50-100 us of a sub-millisecond pull). Safe beside the reader: pyzmq
        checks the socket's events before it receives, and both run on the loop thread.
        It takes everything queued, never stopping early: ZMQ's descriptor is
        edge-triggered, and a reply left behind here might not wake the reader. (Bounded:
        replies answer our own requests in flight, within the socket's receive HWM.)"""
        taken = 0
        while True:
            try:
                frames = self._now.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing queued (EAGAIN), or the socket is closed
                return taken
            self._on_reply(frames)
            taken += 1

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            header, body = P.decode(frames, P.REPLIES)
        except ProtocolError as exc:
            log.warning("undecodable reply from %s: %s", self.address, exc)
            return
        self._saw_instance(header.instance)
        fut = self._waiting.pop(header.id, None)
        if fut is None or fut.done():
            return
        if isinstance(body, P.Error):
            fut.set_exception(error_from_code(body.code, f"peer {self.address}: {body.message}"))
        else:
            fut.set_result(Reply(body, header.instance, self.clock.now()))

    def _saw_instance(self, instance: str) -> None:
        if not instance or instance == self.remote_instance:
            return
        old, self.remote_instance = self.remote_instance, instance
        if old:
            log.warning("peer %s restarted (instance %s -> %s): dropping what was cached",
                        self.address, old, instance, extra={"peer": self.address})
            self._on_lost(self.address, "restarted")

    async def _watch(self) -> None:
        """ZMQ's connection events: a dropped TCP connection means the daemon may be gone."""
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
                self._handshaken = True
            elif event["event"] & (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                err = C.handshake_refusal(f"peer {self.address}", event["event"],
                                          int(event["value"]), self.curve)
                if self.refused is None:  # once per outage, not per redial
                    log.error("%s", err, extra={"peer": self.address})
                self.refused = err
                self._fail_waiting(err)
                if self._on_refused is not None:
                    self._on_refused(self.address)
            elif event["event"] == zmq.EVENT_CONNECTED:
                again = self.connected is False
                self.connected = True
                self._handshaken = False
                self._up.set()
                if again and self._on_up is not None:
                    self._on_up(self.address)
            elif (event["event"] == zmq.EVENT_DISCONNECTED and self.curve
                  and not self._handshaken):
                # A CURVE server that cannot open our HELLO (we hold a key it no longer
                # has: it rotated) closes without a word: a refusal all the same.
                self.connected = False
                self.lost_s = self.clock.now()
                self._up.clear()
                err = C.handshake_refusal(f"peer {self.address}",
                                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, True)
                self.refused = err
                self._fail_waiting(err)
                self._on_lost(self.address, "CURVE handshake refused")
                if self._on_refused is not None:
                    self._on_refused(self.address)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.lost_s = self.clock.now()
                self._up.clear()
                log.info("peer %s disconnected", self.address, extra={"peer": self.address})
                self._fail_waiting()
                self._on_lost(self.address, LOST)

    def _fail_waiting(self, error: KvdError | None = None) -> None:
        """Requests sent before the connection dropped get no answer on it (a redialled
        connection is a new ZMQ session): fail them now, peer_lost, rather than at their
        timeout. Liveness (or the peer's kernel) dropped it, so a partition, a dead or a
        frozen peer fails a handshake or an Acquire within peer_liveness_timeout_s.
        ``error``: the security handshake failed instead (fails them with that)."""
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(error or PeerLostError(
                    f"peer {self.address} is unreachable: its connection dropped before it "
                    "answered"))

    def send(self, msg: Any, timeout_s: float) -> asyncio.Future[Reply]:
        """Put ``msg`` on the wire now (no await: it leaves before the caller's next step).

        The returned future gets the reply; an Error reply as its KvdError class; after
        ``timeout_s`` on the daemon's clock PeerLostError when the connection dropped (the
        daemon died) or KvdTimeoutError when it is connected, or never was, but silent
        (a reply already queued on the socket then is taken first, not timed out);
        PeerLostError sooner when the connection drops (`_fail_waiting`) or is not up
        within the liveness timeout. No task runs for it: the reader fills it, timers
        fail it.
        """
        msg_id = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if self.refused is not None:
            fut.set_exception(self.refused)
            return fut
        sending = self.sock.send_multipart(P.encode(msg, msg_id, self.token, self.own_instance))
        self._waiting[msg_id] = fut
        what = type(msg).__name__

        def expire() -> None:
            if fut.done():
                return
            # The reply may have come while this daemon itself did not run (a stall past
            # the deadline: its timer and the reply are due in the same loop turn, and
            # the reader task would see the reply only a turn later): take what is
            # queued before blaming the peer.
            self.take_ready()
            if not fut.done():
                # pyzmq may have received it already, into the reader's pending recv, in
                # this same loop turn (its I/O callback ran before this timer): the reader
                # hands it over at its wake-up, queued ahead of this.
                asyncio.get_running_loop().call_soon(unanswered)

        def unanswered() -> None:
            if fut.done():
                return
            text = f"peer {self.address} did not answer {what} within {timeout_s}s"
            fut.set_exception(
                PeerLostError(f"{text}: its connection dropped (daemon gone?)")
                if self.connected is False else KvdTimeoutError(text))

        def sent(s: asyncio.Future[Any]) -> None:
            if not fut.done() and not s.cancelled() and s.exception() is not None:
                fut.set_exception(s.exception())  # type: ignore[arg-type]

        def unconnected() -> None:
            if not fut.done() and self.connected is not True:
                fut.set_exception(PeerLostError(
                    f"peer {self.address} is unreachable: no connection to it within "
                    f"{self._liveness_s}s (peer_liveness_timeout_s)"))

        timers = [self.clock.call_later(timeout_s, expire)]
        if (self._liveness_s is not None and self.connected is not True
                and self._liveness_s < timeout_s):
            # Not connected (yet, or any more): heartbeats cannot judge a connection that
            # does not exist, so one that is not up within the liveness timeout counts as
            # lost (a cut link drops the dial's SYNs; a healthy peer connects in ms).
            timers.append(self.clock.call_later(self._liveness_s, unconnected))
        sending.add_done_callback(sent)
        fut.add_done_callback(lambda _: ([t.cancel() for t in timers],
                                         self._waiting.pop(msg_id, None)))
        return fut

    async def reconnected(self, timeout_s: float) -> bool:
        """Whether the connection is up, or comes up within ``timeout_s`` (ZMQ redials a
        dropped one every RECONNECT_INTERVAL_MS: a daemon restarted at this address is
        back within one or two)."""
        if self.connected is not False:
            return True
        try:
            await self.clock.wait_for(self._up.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def request(self, msg: Any, timeout_s: float) -> Reply:
        """Send ``msg`` and await its reply (see `send`)."""
        return await self.send(msg, timeout_s)

    def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        self._reader.cancel()
        self._watcher.cancel()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.sock.close(0)

"""A client that never waits: for code that runs inside an engine's step.

``KvdClient.call`` sends and then waits for the reply; inside vLLM's single-threaded
step that wait stalls every request of the engine, plain ones included, for as long as
the daemon is slow, frozen or gone (13 s of no tokens was measured with a frozen
daemon). ``NoWaitClient`` only ever does non-blocking socket calls: ``send`` queues a
request (or refuses at once when the queue toward the daemon is full) and
``replies`` takes those that have come. Each request carries a caller's tag, handed
back with its reply, so outcomes reach the engine in a later step.

Where the daemon's direct door is reachable (a daemon of this host: loopback or ipc://,
kvd.wire.stream), requests go over it: written by the calling thread into the kernel,
with no ZMQ I/O thread to wait for, and replies are read from it. Otherwise, or once it
broke (the daemon restarted), they go over ZMQ; the door is tried again no sooner than
``DIRECT_RETRY_S`` later and only once every request sent over ZMQ has been answered or
forgotten, so no request overtakes one sent before it.

``batch()`` makes the requests sent inside it leave together, in one write at its end:
a step's pulls then reach the daemon as one burst, which it reads whole before it
delivers their events (kvd.daemon.events.AfterBurst), whether or not this thread is
descheduled between two sends. (ZMQ's I/O thread batches what it finds queued; a
thread writing message by message into the kernel does not.)
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from kvd.client.core import default_address, default_token
from kvd.client.direct import DirectChannel
from kvd.client.sockets import OwnedSockets
from kvd.errors import KvdError
from kvd.wire import protocol as P
from kvd.wire.stream import direct_name

MAX_IN_FLIGHT = 10_000  # requests sent and not yet answered or forgotten
SEND_QUEUE_MESSAGES = 1_000  # ZMQ send high-water mark: past it, send refuses at once
DIRECT_RETRY_S = 1.0  # a door that was not there, or broke, is tried again this much later


def direct_default(env: dict[str, str] | None = None) -> bool:
    """Whether clients use the daemon's direct door: yes unless KVD_ENGINE_DIRECT is
    0/false/no/off (the variable that turns the daemon's ``engine_direct`` off too)."""
    env = os.environ if env is None else env
    return env.get("KVD_ENGINE_DIRECT", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Reply:
    tag: Any
    instance: str  # the answering daemon's incarnation (reply header)
    body: Any  # the reply struct, or P.Error


class NoWaitClient:
    """Fire-and-collect requests to the local kvd; one thread uses it (not thread-safe)."""

    def __init__(self, address: str | None = None, token: str | None = None,
                 direct: bool | None = None) -> None:
        self.address = address or default_address()
        self.token = default_token() if token is None else token
        self._ids = itertools.count(1)
        self._zmq = OwnedSockets(self, zmq.Context())
        self._sock = self._zmq.add(self._zmq.ctx.socket(zmq.DEALER))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
        self._sock.connect(self.address)
        self._in_flight: dict[int, tuple[float, Any]] = {}  # msg id -> (sent_s, tag)
        use_direct = direct_default() if direct is None else direct
        self._direct_name = direct_name(self.address) if use_direct else None
        self._direct: DirectChannel | None = None
        self._direct_tried_s = float("-inf")
        self._over_zmq: set[int] = set()  # ids in flight that went over ZMQ
        self.sent_direct = 0  # requests sent over the direct door (for tests and stats)
        self._batching = 0  # open batch() blocks: door writes wait for the outermost's end

    @property
    def direct(self) -> bool:
        """Whether the direct door is open now."""
        return self._direct is not None and not self._direct.broken

    def _channel(self, now_s: float) -> DirectChannel | None:
        ch = self._direct
        if ch is not None:
            if not ch.broken:
                return ch
            ch.close()
            self._direct = None
        if (self._direct_name is None or self._over_zmq
                or now_s - self._direct_tried_s < DIRECT_RETRY_S):
            return None
        self._direct_tried_s = now_s
        self._direct = DirectChannel.connect(self._direct_name)
        return self._direct

    def open_door(self, now_s: float) -> bool:
        """Open the direct door now, ahead of the first request (an engine at start-up):
        otherwise the first request pays the connect and the daemon's accept on its way
        (1-3 ms of a pair's first hand-over on a 2-core host). Whether it is open; a
        door not there is tried again at a send ``DIRECT_RETRY_S`` later, as always."""
        return self._channel(now_s) is not None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Requests sent inside leave together when the outermost block ends (over the
        door: one write; over ZMQ its I/O thread batches them already). Never waits."""
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if not self._batching and self._direct is not None:
                self._direct.flush()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def send(self, msg: Any, tag: Any, now_s: float) -> bool:
        """Queue ``msg`` without waiting; False if it cannot go now (the daemon has not
        taken the last SEND_QUEUE_MESSAGES, or MAX_IN_FLIGHT are unanswered)."""
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            return False
        msg_id = next(self._ids)
        frames = P.encode(msg, msg_id, self.token)
        ch = self._channel(now_s)
        if ch is not None:
            if ch.send(frames, write=not self._batching):
                self._in_flight[msg_id] = (now_s, tag)
                self.sent_direct += 1
                return True
            if not ch.broken:
                return False  # the daemon is not reading: refused, as ZMQ's HWM would
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._in_flight[msg_id] = (now_s, tag)
        self._over_zmq.add(msg_id)
        return True

    def replies(self) -> list[Reply]:
        """Every reply that has come, with its request's tag; never waits. Replies to
        requests already forgotten (``forget_older``) are dropped."""
        out: list[Reply] = []
        if self._direct is not None:
            for frames in self._direct.receive():
                self._take(list(frames), out)
        while True:
            try:
                zframes = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            self._take(zframes, out)

    def _take(self, frames: list[bytes], out: list[Reply]) -> None:
        try:
            header, body = P.decode(frames, P.REPLIES)
        except KvdError:
            return
        self._over_zmq.discard(header.id)
        sent = self._in_flight.pop(header.id, None)
        if sent is not None:
            out.append(Reply(tag=sent[1], instance=header.instance, body=body))

    def wait_reply(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a reply to have come (True), in the kernel, not
        spinning; ``replies`` then takes it."""
        timeout_ms = max(0, round(timeout_s * 1000))
        ch = self._direct
        if ch is None or ch.broken:
            return bool(self._sock.poll(timeout_ms, zmq.POLLIN))
        ch.flush()
        return bool(zmq.zmq_poll([(self._sock, zmq.POLLIN), (ch.fileno(), zmq.POLLIN)],
                                 timeout_ms))

    def sent_s(self, tag: Any) -> float | None:
        """When the unanswered request tagged ``tag`` was sent (None: none is)."""
        for sent_s, t in self._in_flight.values():
            if t == tag:
                return sent_s
        return None

    def forget_older(self, now_s: float, age_s: float) -> list[Any]:
        """Stop waiting for replies older than ``age_s``; returns their tags."""
        old = [i for i, (sent_s, _) in self._in_flight.items() if now_s - sent_s >= age_s]
        self._over_zmq.difference_update(old)
        return [self._in_flight.pop(i)[1] for i in old]

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()  # (a client collected unclosed: the socket closes itself)
            self._direct = None
        self._zmq.shut()

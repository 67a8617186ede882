"""A client that never waits: for code that runs inside an engine's step.

``KvdClient.call`` sends and then waits for the reply; inside vLLM's single-threaded
step that wait stalls every request of the engine, plain ones included, for as long as
the daemon is slow, frozen or gone (13 s of no tokens was measured with a frozen
daemon). ``NoWaitClient`` only ever does non-blocking socket calls: ``send`` queues a
request (or refuses at once when the queue toward the daemon is full) and
``replies`` takes those that have come. Each request carries a caller's tag, handed
back with its reply, so outcomes reach the engine in a later step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import zmq

from kvd.client.core import default_address, default_token
from kvd.client.sockets import OwnedSockets
from kvd.errors import KvdError
from kvd.wire import protocol as P

MAX_IN_FLIGHT = 10_000  # requests sent and not yet answered or forgotten
SEND_QUEUE_MESSAGES = 1_000  # ZMQ send high-water mark: past it, send refuses at once


@dataclass(frozen=True)
class Reply:
    tag: Any
    instance: str  # the answering daemon's incarnation (reply header)
    body: Any  # the reply struct, or P.Error


class NoWaitClient:
    """Fire-and-collect requests to the local kvd; one thread uses it (not thread-safe)."""

    def __init__(self, address: str | None = None, token: str | None = None) -> None:
        self.address = address or default_address()
        self.token = default_token() if token is None else token
        self._ids = itertools.count(1)
        self._zmq = OwnedSockets(self, zmq.Context())
        self._sock = self._zmq.add(self._zmq.ctx.socket(zmq.DEALER))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
        self._sock.connect(self.address)
        self._in_flight: dict[int, tuple[float, Any]] = {}  # msg id -> (sent_s, tag)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def send(self, msg: Any, tag: Any, now_s: float) -> bool:
        """Queue ``msg`` without waiting; False if it cannot go now (the daemon has not
        taken the last SEND_QUEUE_MESSAGES, or MAX_IN_FLIGHT are unanswered)."""
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            return False
        msg_id = next(self._ids)
        try:
            self._sock.send_multipart(P.encode(msg, msg_id, self.token), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._in_flight[msg_id] = (now_s, tag)
        return True

    def replies(self) -> list[Reply]:
        """Every reply that has come, with its request's tag; never waits. Replies to
        requests already forgotten (``forget_older``) are dropped."""
        out = []
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                header, body = P.decode(frames, P.REPLIES)
            except KvdError:
                continue
            sent = self._in_flight.pop(header.id, None)
            if sent is not None:
                out.append(Reply(tag=sent[1], instance=header.instance, body=body))

    def wait_reply(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a reply to have come (True), in the kernel, not
        spinning; ``replies`` then takes it."""
        return bool(self._sock.poll(max(0, round(timeout_s * 1000)), zmq.POLLIN))

    def sent_s(self, tag: Any) -> float | None:
        """When the unanswered request tagged ``tag`` was sent (None: none is)."""
        for sent_s, t in self._in_flight.values():
            if t == tag:
                return sent_s
        return None

    def forget_older(self, now_s: float, age_s: float) -> list[Any]:
        """Stop waiting for replies older than ``age_s``; returns their tags."""
        old = [i for i, (sent_s, _) in self._in_flight.items() if now_s - sent_s >= age_s]
        return [self._in_flight.pop(i)[1] for i in old]

    def close(self) -> None:
        self._zmq.shut()

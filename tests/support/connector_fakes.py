"""Fakes for the connector's unit tests (no vLLM, no kvd): a NoWaitClient that keeps
what was sent, and a daemon's engine face that answers one Poll late."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from kvd.tools.localcluster import free_port
from kvd.wire import protocol as P
from kvd.wire.protocol import Event


class FakeClient:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.batches: list[list[Any]] = []  # what each batch() block sent, in order
        self._batching = False

    def send(self, msg: Any, tag: Any, now: float) -> bool:
        self.sent.append(msg)
        if self._batching:
            self.batches[-1].append(msg)
        return True

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        assert not self._batching, "the connector never nests its batches"
        self._batching = True
        self.batches.append([])
        try:
            yield
        finally:
            self._batching = False

    def replies(self) -> list[Any]:
        return []

    def forget_older(self, now: float, age_s: float) -> None:
        pass

    def close(self) -> None:
        pass


class FakeDaemon:
    """A ROUTER that answers each Poll after ``delay_s`` with one event (a daemon whose
    pull ends meanwhile), recording the Poll's park time."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.parked_s: list[float] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._sock.poll(20, zmq.POLLIN):
            if self._stop.is_set():
                return
        identity, header, body = self._sock.recv_multipart()
        hdr, poll = P.decode([header, body], P.ENGINE_REQUESTS)
        self.parked_s.append(poll.timeout_s)
        time.sleep(self.delay_s)
        reply = P.Events(events=[Event(kind="done_recving", request_id="r1", ok=True,
                                       seq=1)], instance_id="i1")
        self._sock.send_multipart([identity, *P.encode(reply, hdr.id, instance="i1")])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()

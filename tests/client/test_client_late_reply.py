"""A reply that arrived while the calling thread could not run is taken, not dropped.

Seen in the whole-engine vLLM tests: a vLLM worker (where the connector's event poller
runs) got no CPU for ~30 s; the daemon had answered the poller's Poll in time, but the
thread woke past its deadline, declared a timeout and closed the socket with the reply,
and the events in it, unread.
"""

from __future__ import annotations

import threading
import time

import zmq

import kvd.client.api as client_mod
from kvd.client import KvdClient
from kvd.wire import protocol as P


def _answer_one_poll(router: zmq.Socket, event: P.Event) -> None:
    identity, header, _body = router.recv_multipart()
    msg_id = P.decode_header(header).id
    router.send_multipart([identity, *P.encode(P.Events(events=[event]), msg_id)])


def test_a_poll_reply_that_came_while_the_poller_could_not_run_is_delivered(monkeypatch):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    event = P.Event(kind="done_recving", request_id="r1", ok=True)
    daemon = threading.Thread(target=_answer_one_poll, args=(router, event))
    daemon.start()
    client = KvdClient(f"tcp://127.0.0.1:{port}", timeout_s=1.0, ping_interval_s=0)
    real = time.monotonic
    calls = []

    def starved() -> float:
        # 1st call: the deadline is set. 2nd: the thread runs again only now, long after
        # the daemon answered (which it does while we wait here).
        calls.append(1)
        if len(calls) == 2:
            daemon.join(timeout=5)
            time.sleep(0.1)  # the reply crosses the loopback meanwhile
            return real() + 60.0
        return real() if len(calls) == 1 else real() + 60.0

    monkeypatch.setattr(client_mod.time, "monotonic", starved)
    try:
        events = client.poll("engine", timeout_s=0.5)
    finally:
        monkeypatch.setattr(client_mod.time, "monotonic", real)
        client.close()
        router.close(0)
        ctx.term()
    assert [(e.kind, e.request_id, e.ok) for e in events] == [("done_recving", "r1", True)]

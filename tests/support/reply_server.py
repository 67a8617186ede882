"""A stand-in engine face that answers each Publish after a delay the request names.

Why: to measure how soon a client sees a reply that has arrived, the reply's send time
must be known exactly, and replies must be placed on chosen instants (a poll slice's
end, a call's deadline). Run as ``python -m tests.support.reply_server``: it binds a
ROUTER on an ephemeral loopback port, prints its address, then answers every Publish
whose request_id is ``d<microseconds>`` that long after it came, with
``Published(receipt=<CLOCK_MONOTONIC at the send, repr>)``. Every send is also logged
as ``sent <msg id> <time>`` on stdout (flushed at exit: closing stdin stops it), so a
test can tell when a reply it never took was sent. A separate process, so that neither
its GIL nor its scheduling is the client's.
"""

from __future__ import annotations

import heapq
import sys
import time

import zmq

from kvd.wire import protocol as P


def serve() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    due: list[tuple[float, int, bytes, int]] = []  # (when, seq, identity, msg id)
    log: list[str] = []
    seq = 0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, identity, msg_id = heapq.heappop(due)
            sent = time.monotonic()
            sock.send_multipart([identity, *P.encode(P.Published(receipt=repr(sent)), msg_id)])
            log.append(f"sent {msg_id} {sent!r}")
        wait_ms = 100.0 if not due else max(0.0, (due[0][0] - time.monotonic()) * 1000)
        if due and wait_ms < 2.0:  # the last stretch spun: a reply goes out on its instant
            continue
        ready = dict(poller.poll(wait_ms - 1.0 if due else wait_ms))
        if (sys.stdin in ready or sys.stdin.fileno() in ready) and not sys.stdin.readline():
            break  # stdin closed: stop
        if sock in ready:
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                came = time.monotonic()
                header, body = P.decode(frames[1:], P.ENGINE_REQUESTS)
                delay_s = int(body.request_id[1:]) / 1e6
                seq += 1
                heapq.heappush(due, (came + delay_s, seq, frames[0], header.id))
    print("\n".join(log), flush=True)
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    serve()

"""The ZMQ context and sockets of one client, closed exactly once, also when the client
is collected without ``close()`` (then by a finalizer, so that no thread hangs)."""

from __future__ import annotations

import weakref

import zmq


class OwnedSockets:
    """A client's ZMQ context and the sockets it has open, shut together exactly once: by
    the client's ``close()``, or by a finalizer when the client is collected without one.

    Left to the garbage collector, a context whose socket is still open hangs its thread
    in ``zmq_ctx_term`` for good: the collector clears the context's weak references to
    its sockets before ``Context.__del__`` runs, so its ``destroy()`` closes nothing.
    A client easily sits in a reference cycle (an ``on_lost`` bound to its owner), and
    the thread that collects it may be an engine's. The finalizer holds the context and
    the sockets themselves, so none of them is collected before it closed them
    (tests/client/test_sockets.py)."""

    def __init__(self, owner: object, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.open: list[zmq.Socket] = []
        self._finalizer = weakref.finalize(owner, _shut, ctx, self.open)
        self._finalizer.atexit = False  # at exit a pinger may still use them: left as is

    def add(self, sock: zmq.Socket) -> zmq.Socket:
        self.open.append(sock)
        return sock

    def close(self, sock: zmq.Socket) -> None:
        sock.close(0)
        if sock in self.open:
            self.open.remove(sock)

    def shut(self) -> None:
        self._finalizer()


def _shut(ctx: zmq.Context, socks: list[zmq.Socket]) -> None:
    for sock in socks:
        try:
            sock.close(0)
        except Exception:  # noqa: BLE001 - an asyncio socket whose loop is gone
            zmq.Socket.close(sock, 0)
    socks.clear()
    ctx.term()

"""A raw ZMQ client for tests that talk to a face without kvd's client.

Its context is destroyed on every exit path. A context left to the garbage collector
while its socket is still open hangs in ``zmq_ctx_term`` (the collector clears the
context's weak references to its sockets before ``Context.__del__`` runs, so
``destroy()`` closes nothing): a failed assertion that kept one alive in its traceback
once hung an unrelated later test for pytest-timeout's 300 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import zmq


@contextmanager
def dealer(address: str) -> Iterator[zmq.Socket]:
    """A DEALER connected to ``address`` (linger 0), closed with its context on exit."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        yield s
    finally:
        ctx.destroy(linger=0)

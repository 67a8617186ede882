"""A local pull's peer messages to its own daemon's producer side, in-process.

A pull between two engines of one daemon sends the producer side what a consumer
daemon would send over the peer face (kvd.daemon.pull.local.LocalPeers), for this
daemon's own incarnation. One dispatch for the daemon (kvd.daemon.server) and the fleet
simulation (tests/support/fleet), which only differ in how a reply that must wait (an
Acquire before its Publish, a Watch) is run: ``later`` wraps that awaitable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvd.daemon.produce.producer import Producer
from kvd.errors import ProtocolError
from kvd.wire import protocol as P


def local_peer(producer: Producer, msg: object, instance: str,
               later: Callable[[Awaitable[Any]], Any] = lambda aw: aw) -> object:
    """The reply body, or ``later`` of an awaitable of it."""
    if isinstance(msg, P.Acquire):
        if producer.acquire_must_wait(msg):
            return later(producer.acquire_when_published(msg, instance))
        return producer.acquire(msg, instance)
    if isinstance(msg, P.Heartbeat):
        return producer.heartbeat(msg)
    if isinstance(msg, P.Abandon):
        return producer.abandon(msg)
    if isinstance(msg, P.ReadNotice):
        producer.on_notice(msg, instance)
        return P.Ok()
    if isinstance(msg, P.Watch):
        return later(producer.watch(msg))
    raise ProtocolError(f"a local pull does not send {type(msg).__name__}")

"""The engine's side of kvd: ``KvdClient`` (sync) and ``AsyncKvdClient`` over one sans-IO core.

This package sits above the wire and the pools and below everything that drives an
engine (integrations, tools); it never imports the daemon. Engines import from here,
not from the submodules.
"""

from kvd.client.api import AsyncKvdClient, KvdClient
from kvd.client.core import (
    CLOSE_DEREGISTER_TIMEOUT_S,
    DEFAULT_ADDRESS,
    BlockIds,
    EventCursor,
    EventStash,
    Messages,
    RankHandle,
    default_address,
    default_token,
    engine_hold_id,
)
from kvd.client.nowait import NoWaitClient, Reply

__all__ = [
    "CLOSE_DEREGISTER_TIMEOUT_S",
    "DEFAULT_ADDRESS",
    "AsyncKvdClient",
    "BlockIds",
    "EventCursor",
    "EventStash",
    "KvdClient",
    "Messages",
    "NoWaitClient",
    "RankHandle",
    "Reply",
    "default_address",
    "default_token",
    "engine_hold_id",
]

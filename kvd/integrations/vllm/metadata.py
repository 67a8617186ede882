"""What the scheduler-side connector tells the worker-side one each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """Announcements the worker needs to report kvd's events the way vLLM expects."""

    recv: dict[str, list[int]] = field(default_factory=dict)  # pulls queued: local blocks
    quiet: list[str] = field(default_factory=list)  # notify-only pulls vLLM does not track
    failed: dict[str, list[int]] = field(default_factory=dict)  # pulls the daemon refused
    sent: dict[str, float] = field(default_factory=dict)  # published: give-up time in seconds
    send_refused: list[str] = field(default_factory=list)  # publishes kvd refused: free now


@dataclass
class KvdHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: which daemon hosts this rank, as peers reach it."""

    peer_address: str
    daemon_id: str
    instance_id: str = ""  # the daemon incarnation: the scheduler builds receipts with it

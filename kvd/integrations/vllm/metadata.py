"""What the scheduler-side connector tells the worker-side one each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

try:  # vLLM >= 0.32: worker -> scheduler metadata each step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: the scheduler never hears of a restart
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """Announcements the worker needs to report kvd's events the way vLLM expects."""

    recv: dict[str, list[int]] = field(default_factory=dict)  # pulls queued: local blocks
    quiet: list[str] = field(default_factory=list)  # notify-only pulls vLLM does not track
    failed: dict[str, list[int]] = field(default_factory=dict)  # pulls that could not go
    # Pulls the daemon refused, announced (recv) in an earlier step: failed unless their
    # outcome was already reported (a daemon restart fails them too, exactly once).
    refused: dict[str, list[int]] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)  # published: give-up time in seconds
    send_refused: list[str] = field(default_factory=list)  # publishes kvd refused: free now
    # kvd said this engine is not registered (it restarted): workers register again
    rejoin: bool = False


@dataclass
class KvdHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup: which daemon hosts this rank, as peers reach it."""

    peer_address: str
    daemon_id: str
    instance_id: str = ""  # the daemon incarnation: the scheduler builds receipts with it


@dataclass
class KvdWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler after the rank-0 worker registered again with a restarted
    daemon (kvd.integrations.vllm.rejoin): receipts must name the new instance."""

    peer_address: str
    instance_id: str

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self  # only the rank-0 worker sends one

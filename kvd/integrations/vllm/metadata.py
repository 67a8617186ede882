"""The connector's messages (kvd.integrations.connector_core.messages) in the vLLM
classes vLLM carries between the engine core and its workers."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvd.integrations.connector_core.messages import (
    Handshake,
    StepAnnouncements,
    WorkerRejoined,
)


@dataclass
class KvdConnectorMetadata(StepAnnouncements, KVConnectorMetadata):
    """Scheduler -> workers, each step."""


@dataclass
class KvdHandshake(Handshake, KVConnectorHandshakeMetadata):
    """Worker -> scheduler, at start-up (get_handshake_metadata)."""


@dataclass
class KvdWorkerMeta(WorkerRejoined, KVConnectorWorkerMetadata):
    """Worker -> scheduler, once after a re-registration."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self  # only the rank-0 worker sends one

"""What the consumer and the producer may use of their daemon, and nothing else.

The daemon (kvd.daemon.server) builds one ``Services`` at start and hands it to
both sides: they depend on these parts, never on the daemon, so there is no
import circle and a test can assemble a side from fakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvd.config import Config
from kvd.daemon.clock import Clock
from kvd.daemon.datapath import DataPath
from kvd.daemon.engines.registry import EngineRegistry
from kvd.daemon.events import EventHub
from kvd.daemon.peers.table import PeerTable
from kvd.ops.metrics import Metrics


@dataclass
class Services:
    cfg: Config
    clock: Clock
    metrics: Metrics
    datapath: DataPath
    registry: EngineRegistry
    peers: PeerTable
    events: EventHub
    spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    daemon_id: str
    instance_id: str  # this incarnation: random per process, in every reply header
    # OpenTelemetry spans (kvd.ops.otel.Spans) when ``otel_traces`` is on; None: off, and
    # nothing of OpenTelemetry is imported.
    spans: Any = None

"""What the connector's two halves tell each other, as plain dataclasses.

The scheduler half (engine-core process) sends ``StepAnnouncements`` to the worker
half (each worker process) once a step; the worker sends ``Handshake`` once at
start-up and ``WorkerRejoined`` after it registered again with a restarted daemon.
vLLM carries them in its own metadata classes: ``kvd.integrations.vllm.metadata``
subclasses each of these with vLLM's base class, and the connector converts at the
boundary (``as_vllm``), so nothing here needs vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class StepAnnouncements:
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
    # the step computes no token (every request waits for its KV): the rank-0 worker
    # may wait in it for kvd's events instead of spinning through empty steps
    idle: bool = False
    # the step computes no token and every pull the engine waits for is progressive
    # (waiting.py): the worker may wait longer, kvd_progressive_idle_wait_s
    only_progressive: bool = False
    # progressive prefills: the transfer id a request was sealed under -> its request id
    # (the daemon's done_sending names the transfer id)
    aliases: dict[str, str] = field(default_factory=dict)


@dataclass
class Handshake:
    """Worker -> scheduler at startup: which daemon hosts this rank, as peers reach it."""

    peer_address: str
    daemon_id: str
    instance_id: str = ""  # the daemon incarnation: the scheduler builds receipts with it


@dataclass
class WorkerRejoined:
    """Worker -> scheduler after the rank-0 worker registered again with a restarted
    daemon (kvd.integrations.connector_core.rejoin): receipts must name the new instance."""

    peer_address: str
    instance_id: str


def as_vllm(message: Any, cls: type[T]) -> T:
    """``message``'s fields in ``cls`` (its vLLM-carried subclass), shared, not copied."""
    return cls(**{f.name: getattr(message, f.name) for f in fields(message)})

"""The small interface kvd needs from NIXL.

The daemon talks only to this protocol; `NixlTransport` implements it with the
real agent, `LoopbackTransport` (tests) with memcpy inside one process. Every
method is called from one dedicated thread (see kvd.daemon.datapath), so
implementations need no locking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class TransportCounts:
    """Live objects, for leak checks: all must be zero after a clean shutdown."""

    registrations: int = 0
    transfers: int = 0
    peers: int = 0


@dataclass(frozen=True)
class ReadPost:
    """One READ of many descriptors from one peer: parallel arrays, one row each."""

    peer: str
    local_addrs: np.ndarray
    remote_addrs: np.ndarray
    nbytes: np.ndarray
    mem_type: str
    notif: bytes
    local_devs: np.ndarray | None = None  # GPU index per descriptor (None: all 0, DRAM)
    remote_devs: np.ndarray | None = None


class Transport(Protocol):
    name: str

    def metadata(self) -> bytes:
        """Agent metadata including every registered region (refresh after registering)."""
        ...

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int: ...

    def deregister(self, reg_id: int) -> None: ...

    def add_peer(self, metadata: bytes) -> str:
        """Load (or refresh) a remote agent's metadata; returns its agent name."""
        ...

    def remove_peer(self, agent_name: str) -> None: ...

    def post_read(self, post: ReadPost) -> tuple[int, bool]:
        """Post one READ of many descriptors; returns (xfer id, already done)."""
        ...

    def poll(self, xfer_id: int) -> bool:
        """True when done; raises TransferError when the transfer failed."""
        ...

    def release(self, xfer_id: int) -> None:
        """Release (and abort, if still running) a transfer handle."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]: ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def counts(self) -> TransportCounts: ...

    def close(self) -> None: ...

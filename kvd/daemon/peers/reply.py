"""A peer daemon's reply as this daemon received it: a value, no I/O (the pull's machine
and its Acquire rules read it; kvd.daemon.peers.conn makes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    body: Any
    instance: str  # the answering daemon's incarnation ("" from a daemon too old to say)
    received_s: float = 0.0  # when it arrived, on the daemon's clock

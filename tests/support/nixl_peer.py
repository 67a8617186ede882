"""A NIXL target in a spawned process for transport tests: owns a patterned buffer.

The parent gets (agent metadata, buffer address, buffer bytes) and then may ask
for the notifications received so far; the child polls NIXL continuously (a READ
carrying a notification is not DONE at the initiator until the target polls).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def pattern(nbytes: int) -> np.ndarray:
    """The bytes the target holds: a fixed pseudo-random sequence (no two chunks alike)."""
    return np.random.default_rng(1234).integers(0, 256, nbytes, dtype=np.uint8)


def serve(conn: Any, nbytes: int) -> None:
    from kvd.transport.remote.nixl import NixlTransport

    transport = NixlTransport(name="test-target")
    buf = pattern(nbytes)
    transport.register(int(buf.ctypes.data), nbytes, "DRAM", 0)
    conn.send((transport.metadata(), int(buf.ctypes.data)))
    received: list[bytes] = []
    while True:
        received.extend(msg for _, msg in transport.notifications())
        if conn.poll(0.0005):
            cmd = conn.recv()
            if cmd == "notifs":
                conn.send(list(received))
            elif cmd == "stop":
                transport.close()
                conn.send("stopped")
                return

"""Daemon processes killed and restarted on their addresses: the set-up the restart
tests share (tests/daemon/peers/test_restart.py, tests/pool/test_adopt_restart.py,
tests/pool/test_adopt_memfd.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from kvd.client import KvdClient
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec

MODEL = ModelSpec(name="restart", num_kv_heads=4, num_layers=8, head_dim=64)
BIG = EngineShape(tp_size=1, num_blocks=512)  # 64 KiB per block-layer-kv: 32 MiB a request
SMALL_IDS = [3, 5, 7]
# File-backed pools on every host: these tests reap and count pool files, which memfd
# pools (chosen by pool_backing=auto where 2 MiB pages are reserved) never leave.
ARGS = ["--set", "handshake_timeout_s=2", "--set", "heartbeat_interval_s=0.5",
        "--set", "pool_backing=shm"]


def start_daemon(tmp: Path, name: str, like: DaemonProcess | None = None) -> DaemonProcess:
    """A ``kvd serve`` process with shm pools; ``like``: on that one's addresses."""
    if like is None:
        return DaemonProcess.start(name, tmp, extra_args=ARGS)
    return DaemonProcess.start(name, tmp / "again", extra_args=ARGS,
                               engine_address=like.engine_address, peer_address=like.peer_address)


def kill9(d: DaemonProcess) -> None:
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(10)


def cleanup(*daemons: DaemonProcess) -> None:
    for d in daemons:
        d.stop()
        for name in kvd_segments(f"kvd-{d.name}"):  # a SIGKILLed incarnation's pools
            (SHM_DIR / name).unlink(missing_ok=True)


def pull_small(pc: KvdClient, dc: KvdClient, paddr: str, rid: str, dst: list[int]
               ) -> tuple[object, object]:
    """Publish SMALL_IDS as ``rid`` on "pre" and pull them into ``dst`` of "dec"; both
    events (done_recving, done_sending)."""
    pc.publish("pre", rid, SMALL_IDS)
    dc.pull("dec", rid, "pre", paddr, SMALL_IDS, dst, num_tokens=len(SMALL_IDS) * 16)
    return dc.wait("dec", rid, "done_recving", timeout_s=20), pc.wait("pre", rid,
                                                                      "done_sending", 20)

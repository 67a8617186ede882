"""A daemon that merely holds published requests must not burn a core polling NIXL."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvd.tools.localcluster import DaemonProcess
from kvd.wire.protocol import LayoutSpec, ModelSpec

pytestmark = pytest.mark.nixl


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_holding_daemon_is_nearly_idle(tmp_path):
    d = DaemonProcess.start("idle", tmp_path)
    try:
        with d.client() as c:
            c.register("e", ModelSpec(name="m", num_kv_heads=2, num_layers=2, head_dim=16),
                       LayoutSpec(num_blocks=8, block_size_tokens=16))
            for i in range(10):
                c.publish("e", f"r{i}", [1], lease_s=60)
            time.sleep(0.5)  # past the hot window that follows the publishes
            t0, c0 = time.monotonic(), _cpu_s(d.proc.pid)
            time.sleep(3)
            share = (_cpu_s(d.proc.pid) - c0) / (time.monotonic() - t0)
            # Measured ~0.5% of a core; a busy-polling loop costs ~100%.
            assert share < 0.15, f"holding daemon used {share:.0%} of a core"
    finally:
        d.stop()

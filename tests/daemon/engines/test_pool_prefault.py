"""The first pull after registration does not fault the pools' pages in on its path:
the daemon maps every page of a new DRAM pool ahead of traffic (kvd.pool.prefault).
Counted, not timed: the daemon process's page faults during a hand-over-sized local
pull into blocks never used before (a fault per 4 KiB page written without it)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from support.cluster import start_daemon, stop_and_check_clean

from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="tiny", num_kv_heads=2, num_layers=4, head_dim=64, dtype="float32")
SHAPE = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=64)  # 128 KiB blocks
BLOCKS = 25  # an 800-token prompt: 3.2 MB, 800 pages


def _faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])  # minflt + majflt


def _settled(pid: int, quiet_s: float = 0.5, timeout_s: float = 120.0) -> int:
    """The daemon's fault count once it stopped growing (its prefault threads ended)."""
    deadline = time.monotonic() + timeout_s
    last = _faults(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = _faults(pid)
        if now - last < 8:
            return now
        last = now
    raise AssertionError("the daemon kept faulting pages in for two minutes")


@pytest.mark.parametrize("prefault", [True, False])
def test_the_first_pull_after_registration_faults_no_page_in(tmp_path: Path,
                                                             prefault: bool) -> None:
    d = start_daemon(tmp_path, "pf", ["--set", f"prefault_pools={str(prefault).lower()}"])
    c = d.client(timeout_s=30)
    try:
        p = c.register("P", MODEL, layout_spec(SHAPE), 0, 1)
        c.register("D", MODEL, layout_spec(SHAPE), 0, 1)
        p.kv.reshape(-1).view(np.uint8)[:] = 5  # the producer engine wrote its KV
        src, dst = list(range(BLOCKS)), list(range(SHAPE.num_blocks - BLOCKS, SHAPE.num_blocks))
        receipt = c.publish("P", "r0", src)
        before = _settled(d.proc.pid)
        ev = c.pull_and_wait("D", "r0", "P", d.peer_address, src, dst,
                             publish_receipt=receipt, timeout_s=30)
        faults = _faults(d.proc.pid) - before
        assert ev.ok, ev.error
        pages = BLOCKS * (128 << 10) // 4096
        if prefault:
            assert faults < pages // 8, f"{faults} page faults during the first pull"
        else:  # what it saves: the copy faults the destination in page by page
            assert faults >= pages // 2
    finally:
        c.close()
        stop_and_check_clean(d)

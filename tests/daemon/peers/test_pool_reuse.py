"""Regression: pools freed and their addresses reused by new pools of another geometry.

NIXL keeps a peer's old memory sections when its metadata is loaded again; a READ
that starts inside a stale section (a freed pool whose address range a new, larger
pool now covers) failed with NIXL_ERR_NOT_FOUND. kvd reloads a changed peer afresh.
"""

from __future__ import annotations

import random
import time

import pytest

from kvd.pool.shm import kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="reuse", num_kv_heads=8, num_layers=4, head_dim=64)


def _case(prefill, decode, pc, dc, tag: str, ptp: int, dtp: int) -> None:
    ps, ds = EngineShape(ptp, num_blocks=40), EngineShape(dtp, num_blocks=40)
    g = global_kv(MODEL, 256)
    rng = random.Random(3)
    p_ids, d_ids = rng.sample(range(40), 16), rng.sample(range(40), 16)
    pr = [pc.register(f"p{tag}", MODEL, layout_spec(ps), t, ptp) for t in range(ptp)]
    dr = [dc.register(f"d{tag}", MODEL, layout_spec(ds), t, dtp) for t in range(dtp)]
    for r in pr:
        write_shard(r.kv, g, MODEL, ps, r.tp_rank, 0, p_ids)
    pc.publish(f"p{tag}", "r", p_ids)
    dc.pull(f"d{tag}", "r", f"p{tag}", prefill.peer_address, p_ids, d_ids)
    ev = dc.wait(f"d{tag}", "r", "done_recving", timeout_s=30)
    assert ev.ok, ev.error
    for r in dr:
        assert check_shard(r.kv, g, MODEL, ds, r.tp_rank, 0, d_ids) == 0
    for r in pr:
        pc.deregister(r)
    for r in dr:
        dc.deregister(r)
    deadline = time.monotonic() + 10  # wait until the pools are really freed
    while kvd_segments("kvd-reusep") or kvd_segments("kvd-reused"):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_new_pools_over_freed_addresses_transfer_correctly(tmp_path):
    prefill = DaemonProcess.start("reusep", tmp_path)
    decode = DaemonProcess.start("reused", tmp_path)
    try:
        with prefill.client() as pc, decode.client() as dc:
            _case(prefill, decode, pc, dc, "1", 2, 2)
            _case(prefill, decode, pc, dc, "2", 1, 2)  # one bigger pool over the freed two
            _case(prefill, decode, pc, dc, "3", 4, 1)
    finally:
        prefill.stop()
        decode.stop()

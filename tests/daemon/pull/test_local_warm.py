"""One daemon for both engines: registering an engine warms its local pairs (the
in-process handshake, the plan, the prepared assembly, both ways), so the first pull
between two engines plans nothing on its path. Counted, not timed: the daemon's plan
cache misses happen at registration, and the first pull is a hit."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from support.cluster import metric, start_daemon, stop_and_check_clean

from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="tiny", num_kv_heads=2, num_layers=4, head_dim=64, dtype="float32")
SHAPE = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=64)
OTHER = ModelSpec(name="other", num_kv_heads=4, num_layers=4, head_dim=64, dtype="float32")


def _misses(d) -> float:
    return metric(d, "kvd_plan_cache_misses_total")


def _hits(d) -> float:
    return metric(d, "kvd_plan_cache_hits_total")


def test_the_first_local_pull_after_registration_plans_nothing(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "warm")
    c = d.client(timeout_s=30)
    try:
        p = c.register("P", MODEL, layout_spec(SHAPE), 0, 1)
        c.register("X", OTHER, layout_spec(SHAPE), 0, 1)  # incompatible: not paired
        assert _misses(d) == 0  # one engine of each model: nothing to warm yet
        c.register("D", MODEL, layout_spec(SHAPE), 0, 1)
        # D <- P, then P <- D: one plan (same geometry both ways), two assemblies
        deadline = time.monotonic() + 30
        while _hits(d) + _misses(d) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        warmed, hits = _misses(d), _hits(d)
        assert (warmed, hits) == (1, 1)
        p.kv.reshape(-1).view(np.uint8)[:] = 9
        ids = list(range(25))
        receipt = c.publish("P", "r0", ids)
        ev = c.pull_and_wait("D", "r0", "P", d.peer_address, ids, ids,
                             publish_receipt=receipt, timeout_s=30)
        assert ev.ok, ev.error
        assert _misses(d) == warmed  # the first pull planned nothing
        assert _hits(d) == hits + 1  # its prepared assembly, made at registration
        assert metric(d, "kvd_transfers_total", role="consumer", path="local") == 1
    finally:
        c.close()
        stop_and_check_clean(d)

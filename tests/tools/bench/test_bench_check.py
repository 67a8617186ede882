"""`benchmarks/check_bench.py` (the independent check of `kvd bench`) end to end on a
small request: two daemons, a parked poller, receipts, byte-exact, every figure there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "check_bench.py"


def test_independent_check_reports_verified_figures() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--nbytes-mib", "8", "--repeats", "1",
                          "--latency-pulls", "5", "--json"],
                         capture_output=True, text=True, timeout=240, check=True).stdout
    res = json.loads(out[out.index("{"):])
    assert res["verified"] is True
    for key in ("memcpy_gbps", "nixl_gbps_shm", "kvd_client_gbps", "kvd_daemon_metrics_gbps",
                "pull_1block_p50_ms", "ratio_kvd_nixl_shm"):
        assert res[key] > 0, key

"""A real Prometheus server scrapes two kvd daemons while they transfer.

Proves what a unit test of the exposition cannot: Prometheus accepts the format,
the counters arrive with their labels, and the histogram buckets support
``histogram_quantile`` over ``rate()`` as the Grafana dashboard uses it.

Needs the ``prometheus`` binary (Debian: ``apt-get install -y prometheus``; ``.ci/run``
installs it). Skipped, saying so, only where it is not installed.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess, free_port
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="prom-model", num_kv_heads=4, num_layers=4, head_dim=64)
PSHAPE = EngineShape(tp_size=2, block_size_tokens=16, num_blocks=64)
DSHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=64)
TRANSFERS = 3
TOKENS = 128


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
    if path is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install -y prometheus; "
                    ".ci/run installs it): cannot check kvd's metrics with a real server")
    return path


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        static = "\n".join(
            f"      - targets: ['127.0.0.1:{port}']\n        labels: {{kvd: {name}}}"
            for name, port in targets.items())
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: kvd\n    scrape_interval: 1s\n"
            f"    scrape_timeout: 900ms\n    static_configs:\n{static}\n")
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]

    def wait_ready(self, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"prometheus not ready after {timeout_s}s:\n{self.log()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = get_json(url)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, pred: Any, timeout_s: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result and pred(result):
                return result
            time.sleep(0.25)
        raise AssertionError(f"{what}: {expr} -> {result} after {timeout_s}s\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scalar(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    tag = uuid.uuid4().hex[:6]
    started: list[DaemonProcess] = []
    try:
        started.append(DaemonProcess.start(f"prom-p-{tag}", tmp_path / "logs"))
        started.append(DaemonProcess.start(f"prom-d-{tag}", tmp_path / "logs"))
        yield started[0], started[1]
    finally:
        for d in started:
            rc = d.stop()
            for name in kvd_segments(f"kvd-{d.name}"):
                (SHM_DIR / name).unlink(missing_ok=True)
            assert rc == 0, d.log_path.read_text()[-3000:]


def test_prometheus_scrapes_counters_and_histograms(
        tmp_path: Path, daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    binary = prometheus_binary()
    prefill, decode = daemons
    prom = Prometheus(binary, tmp_path,
                      {"prefill": prefill.metrics_port, "decode": decode.metrics_port})
    pc, dc = prefill.client(), decode.client()
    try:
        prom.wait_ready()
        # Both targets up and scraped at least once before any transfer, so that
        # rate() sees the counters rise from their zeros.
        prom.wait_for('up{job="kvd"}', lambda r: len(r) == 2 and all(
            x["value"][1] == "1" for x in r), 15, "both kvd targets up")
        prom.wait_for('kvd_transfers_total{kvd="decode",role="consumer",outcome="ok"}',
                      lambda r: scalar(r) == 0, 10, "the zero counter scraped")

        p_ranks = [pc.register("pre", MODEL, layout_spec(PSHAPE), t, PSHAPE.tp_size)
                   for t in range(PSHAPE.tp_size)]
        d_ranks = [dc.register("dec", MODEL, layout_spec(DSHAPE), 0, DSHAPE.tp_size)]
        rng = random.Random(5)
        n = TOKENS // PSHAPE.block_size_tokens
        total_bytes = 0
        for i in range(TRANSFERS):
            p_ids = rng.sample(range(PSHAPE.num_blocks), n)
            d_ids = rng.sample(range(DSHAPE.num_blocks), n)
            g = global_kv(MODEL, TOKENS, seed=i)
            for r in p_ranks:
                write_shard(r.kv, g, MODEL, PSHAPE, r.tp_rank, r.pp_rank, p_ids)
            pc.publish("pre", f"prom-{i}", p_ids)
            dc.pull("dec", f"prom-{i}", "pre", prefill.peer_address, p_ids, d_ids)
            ev = dc.wait("dec", f"prom-{i}", "done_recving", timeout_s=20)
            assert ev.ok, ev.error
            assert pc.wait("pre", f"prom-{i}", "done_sending", timeout_s=20).ok
            assert check_shard(d_ranks[0].kv, g, MODEL, DSHAPE, 0, 0, d_ids) == 0
            total_bytes += ev.nbytes

        # Each target is scraped on its own schedule: wait for each value, do not
        # assume one scrape of the decode daemon implies a fresh one of the prefill.
        def eventually(expr: str, want: float, what: str) -> None:
            prom.wait_for(expr, lambda r: scalar(r) == want, 15, what)

        # Summed over both targets: the prefill daemon's consumer series stays at 0.
        eventually('sum(kvd_transfers_total{role="consumer",outcome="ok"})', TRANSFERS,
                   "consumer transfers counted")
        eventually('kvd_transfers_total{kvd="decode",role="consumer",outcome="ok"}', TRANSFERS,
                   "decode transfers")
        eventually('kvd_transfers_total{kvd="prefill",role="producer",outcome="ok"}', TRANSFERS,
                   "producer releases")
        eventually('kvd_transferred_bytes_total{kvd="decode",role="consumer"}', total_bytes,
                   "consumer bytes")
        eventually('kvd_transferred_bytes_total{kvd="prefill",role="producer"}', total_bytes,
                   "producer bytes")
        eventually('sum(kvd_handshakes_total{outcome="ok"})', 1, "one handshake")
        eventually('kvd_plan_cache_hits_total{kvd="decode"}', TRANSFERS - 1, "plan cache hits")
        eventually('kvd_engines_registered{kvd="prefill"}', 2, "prefill ranks")
        build = prom.query("kvd_build_info")
        assert len(build) == 2 and all(x["metric"]["version"] for x in build)

        p50 = prom.wait_for(
            "histogram_quantile(0.5, sum(rate(kvd_transfer_duration_seconds_bucket[1m])) by (le))",
            lambda r: not math.isnan(scalar(r)), 15, "a transfer latency median")
        median = scalar(p50)
        assert 0 < median < 60, median
        p99 = scalar(prom.query(
            'histogram_quantile(0.99, sum(rate(kvd_transfer_duration_seconds_bucket'
            '{role="consumer"}[1m])) by (le))'))
        assert math.isfinite(p99) and p99 >= 0
    finally:
        pc.close()
        dc.close()
        rc = prom.stop()
    assert rc == 0, prom.log()

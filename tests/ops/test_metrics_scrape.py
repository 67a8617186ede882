"""Metrics after real transfers, scraped over HTTP from two daemon processes.

Exact values, not "> 0": a counter that double-counts, a gauge that is never
decremented or a histogram observed twice per request all fail here. Also the
health endpoints, including /readyz turning 503 while a SIGTERM'd daemon drains.
"""

from __future__ import annotations

import random
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvd
from kvd.client import KvdClient, RankHandle
from kvd.errors import DrainingError
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import DTYPE_NBYTES, ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="scrape-model", num_kv_heads=4, num_layers=4, head_dim=64,
                  dtype="bfloat16")
PSHAPE = EngineShape(tp_size=2, block_size_tokens=16, num_blocks=48)
DSHAPE = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=48)
TOKENS = 256  # 16 full blocks on both sides


# ------------------------------------------------------------------ helpers


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(d: DaemonProcess) -> Samples:
    """Every sample of the daemon's /metrics, parsed by prometheus_client's own parser."""
    status, text = http_get(d.metrics_port, "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels} in the scrape"
    return samples[key]


def block_nbytes(shape: EngineShape) -> int:
    """Bytes one block occupies across all ranks of an engine (K and V, every layer, head)."""
    return (2 * MODEL.num_layers * shape.block_size_tokens * MODEL.num_kv_heads
            * MODEL.head_dim * DTYPE_NBYTES[MODEL.dtype])


def stop(d: DaemonProcess) -> None:
    rc = d.stop()
    for name in kvd_segments(f"kvd-{d.name}"):  # never leave junk behind, even on failure
        (SHM_DIR / name).unlink(missing_ok=True)
    assert rc == 0, f"{d.name} exited {rc}:\n{d.log_path.read_text()[-3000:]}"


@dataclass
class Cluster:
    prefill: DaemonProcess
    decode: DaemonProcess
    pc: KvdClient
    dc: KvdClient


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("scrape-logs")
    tag = uuid.uuid4().hex[:6]
    prefill = DaemonProcess.start(f"scrape-p-{tag}", logs)
    try:
        decode = DaemonProcess.start(f"scrape-d-{tag}", logs)
    except BaseException:
        stop(prefill)
        raise
    pc, dc = prefill.client(), decode.client()
    try:
        yield Cluster(prefill, decode, pc, dc)
    finally:
        pc.close()
        dc.close()
        stop(prefill)
        stop(decode)


def pull_once(c: Cluster, p_ranks: list[RankHandle], d_ranks: list[RankHandle],
              seed: int) -> tuple[int, list[int]]:
    """Publish and pull one request of TOKENS tokens; return (nbytes, local ids)."""
    rng = random.Random(seed)
    n = TOKENS // PSHAPE.block_size_tokens
    p_ids, d_ids = rng.sample(range(PSHAPE.num_blocks), n), rng.sample(range(DSHAPE.num_blocks), n)
    g = global_kv(MODEL, TOKENS, seed=seed)
    for r in p_ranks:
        write_shard(r.kv, g, MODEL, PSHAPE, r.tp_rank, r.pp_rank, p_ids)
    rid = f"scrape-{seed}"
    c.pc.publish("pre", rid, p_ids)
    c.dc.pull("dec", rid, "pre", c.prefill.peer_address, p_ids, d_ids)
    recv = c.dc.wait("dec", rid, "done_recving", timeout_s=20)
    sent = c.pc.wait("pre", rid, "done_sending", timeout_s=20)
    assert recv.ok, recv.error
    assert sent.ok, sent.error
    assert sent.nbytes == recv.nbytes  # the producer hears the bytes in the READ notices
    assert sum(check_shard(r.kv, g, MODEL, DSHAPE, r.tp_rank, r.pp_rank, d_ids)
               for r in d_ranks) == 0
    return recv.nbytes, d_ids


# ------------------------------------------------------------------ tests


def test_health_endpoints_of_a_running_daemon(cluster: Cluster) -> None:
    for d in (cluster.prefill, cluster.decode):
        assert http_get(d.metrics_port, "/livez") == (200, "ok\n")
        status, body = http_get(d.metrics_port, "/readyz")
        assert status == 200, body
        assert http_get(d.metrics_port, "/nope")[0] == 404


def test_metrics_after_transfers_are_exact(cluster: Cluster) -> None:
    c = cluster
    before_p, before_d = scrape(c.prefill), scrape(c.decode)
    # Fresh daemons: every labelled child exists up front, at zero.
    assert value(before_d, "kvd_transfers_total", role="consumer", path="remote", outcome="ok") == 0
    assert value(before_d, "kvd_handshakes_total", outcome="ok") == 0
    assert value(before_p, "kvd_engines_registered") == 0

    p_ranks = [c.pc.register("pre", MODEL, layout_spec(PSHAPE), t, PSHAPE.tp_size)
               for t in range(PSHAPE.tp_size)]
    d_ranks = [c.dc.register("dec", MODEL, layout_spec(DSHAPE), 0, DSHAPE.tp_size)]
    nbytes, d_ids = pull_once(c, p_ranks, d_ranks, seed=11)
    expected_bytes = len(d_ids) * block_nbytes(DSHAPE)
    assert nbytes == expected_bytes  # the done_recving event agrees with the geometry

    p, d = scrape(c.prefill), scrape(c.decode)
    # consumer side
    assert value(d, "kvd_transfers_total", role="consumer", path="remote", outcome="ok") == 1
    for outcome in ("failed", "expired", "cancelled"):
        assert value(d, "kvd_transfers_total", role="consumer", path="remote", outcome=outcome) == 0
    assert value(d, "kvd_transferred_bytes_total", role="consumer", path="remote") == expected_bytes
    assert value(d, "kvd_transfer_duration_seconds_count", role="consumer", path="remote") == 1
    assert 0 < value(d, "kvd_transfer_duration_seconds_sum", role="consumer", path="remote") < 20
    assert value(d, "kvd_transfer_duration_seconds_bucket", role="consumer", path="remote",
                 le="+Inf") == 1
    assert value(d, "kvd_transfer_post_duration_seconds_count") == 1
    assert value(d, "kvd_descriptors_posted_total") > 0
    assert value(d, "kvd_handshakes_total", outcome="ok") == 1
    for outcome in ("failed", "timeout", "refused"):
        assert value(d, "kvd_handshakes_total", outcome=outcome) == 0
    assert value(d, "kvd_handshake_duration_seconds_count") == 1
    assert value(d, "kvd_peers_connected") == 1
    assert value(d, "kvd_plan_cache_misses_total") == 1
    assert value(d, "kvd_plan_cache_hits_total") == 0
    assert value(d, "kvd_inflight_transfers") == 0
    assert value(d, "kvd_invalid_blocks_total") == 0
    assert value(d, "kvd_engines_registered") == 1
    assert value(d, "kvd_pool_registered_bytes") == sum(r.pool.handle.nbytes for r in d_ranks)
    # producer side
    assert value(p, "kvd_transfers_total", role="producer", path="remote", outcome="ok") == 1
    assert value(p, "kvd_transfers_total", role="producer", path="remote", outcome="expired") == 0
    assert value(p, "kvd_transfer_duration_seconds_count", role="producer", path="remote") == 1
    assert value(p, "kvd_transferred_bytes_total", role="producer", path="remote") == expected_bytes
    assert value(p, "kvd_transfers_total", role="consumer", path="remote", outcome="ok") == 0
    assert value(p, "kvd_held_requests") == 0
    assert value(p, "kvd_leases_expired_total") == 0
    assert value(p, "kvd_notifications_failed_total") == 0
    assert value(p, "kvd_engines_registered") == 2
    assert value(p, "kvd_pool_registered_bytes") == sum(r.pool.handle.nbytes for r in p_ranks)
    assert value(p, "kvd_handshakes_total", outcome="ok") == 0  # the consumer initiates
    for samples in (p, d):
        assert value(samples, "kvd_build_info", version=kvd.__version__) == 1
        assert sum(v for (name, _), v in samples.items()
                   if name in ("kvd_protocol_errors_total", "kvd_auth_failures_total")) == 0

    # A second pull of the same engine pair: cached handshake and cached plan.
    nbytes2, d_ids2 = pull_once(c, p_ranks, d_ranks, seed=12)
    assert nbytes2 == len(d_ids2) * block_nbytes(DSHAPE)
    p, d = scrape(c.prefill), scrape(c.decode)
    assert value(d, "kvd_plan_cache_hits_total") == 1
    assert value(d, "kvd_plan_cache_misses_total") == 1
    assert value(d, "kvd_handshakes_total", outcome="ok") == 1
    assert value(d, "kvd_transfers_total", role="consumer", path="remote", outcome="ok") == 2
    assert (value(d, "kvd_transferred_bytes_total", role="consumer", path="remote")
            == nbytes + nbytes2)
    assert value(d, "kvd_transfer_duration_seconds_count", role="consumer", path="remote") == 2
    assert value(p, "kvd_transfers_total", role="producer", path="remote", outcome="ok") == 2
    assert (value(p, "kvd_transferred_bytes_total", role="producer", path="remote")
            == nbytes + nbytes2)
    assert value(p, "kvd_held_requests") == 0
    assert value(d, "kvd_inflight_transfers") == 0

    # Held gauge while a request is published and nobody pulls it.
    c.pc.publish("pre", "scrape-held", [0, 1], lease_s=60)
    assert value(scrape(c.prefill), "kvd_held_requests") == 1

    # Deregistering frees the pools (the held request is released with its engine).
    for r in p_ranks:
        c.pc.deregister(r)
    for r in d_ranks:
        c.dc.deregister(r)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        p, d = scrape(c.prefill), scrape(c.decode)
        if value(p, "kvd_pool_registered_bytes") == 0 == value(d, "kvd_pool_registered_bytes"):
            break
        time.sleep(0.05)
    assert value(p, "kvd_pool_registered_bytes") == 0
    assert value(d, "kvd_pool_registered_bytes") == 0
    assert value(p, "kvd_engines_registered") == 0 == value(d, "kvd_engines_registered")
    assert value(p, "kvd_held_requests") == 0
    assert value(p, "kvd_transfers_total", role="producer", path="remote", outcome="cancelled") == 1


def test_readyz_turns_503_while_draining_then_exits_0(tmp_path: Path) -> None:
    d = DaemonProcess.start(f"scrape-drain-{uuid.uuid4().hex[:6]}", tmp_path,
                            extra_args=["--set", "drain_timeout_s=3"])
    client = d.client(ping_interval_s=0)
    try:
        assert http_get(d.metrics_port, "/readyz")[0] == 200
        client.register("pre", MODEL, layout_spec(PSHAPE), 0, PSHAPE.tp_size)
        client.publish("pre", "held-through-drain", [0, 1, 2], lease_s=60)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        status, body = 0, ""
        while time.monotonic() - t0 < 2:
            status, body = http_get(d.metrics_port, "/readyz")
            if status == 503:
                break
            time.sleep(0.02)
        assert (status, body.strip()) == (503, "draining")
        assert http_get(d.metrics_port, "/livez")[0] == 200  # alive while draining
        with pytest.raises(DrainingError):
            client.publish("pre", "too-late", [3], lease_s=60)
        # The held request keeps the daemon up until drain_timeout_s, then it exits 0.
        rc = d.proc.wait(timeout=3 + 5)
        elapsed = time.monotonic() - t0
        assert rc == 0, d.log_path.read_text()[-3000:]
        assert 2.5 <= elapsed <= 8, f"drain took {elapsed:.2f}s with drain_timeout_s=3"
        assert not kvd_segments(f"kvd-{d.name}")
    finally:
        client.close()
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        for name in kvd_segments(f"kvd-{d.name}"):
            (SHM_DIR / name).unlink(missing_ok=True)


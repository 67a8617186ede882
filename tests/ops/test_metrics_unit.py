"""Metrics: names, labels and values as Prometheus sees them (parsed exposition).

The logging setup (kvd.ops.logsetup) has its own module: tests/ops/test_logsetup.py.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvd
from kvd.ops.metric_docs import METRIC_DOCS, metric_names
from kvd.ops.metrics import Metrics


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by (series name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_documented_metric_is_exposed_with_its_type_and_help() -> None:
    m = Metrics()
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
    }
    for doc in METRIC_DOCS:
        family = families[doc.base_name]
        assert family.type == doc.type
        assert family.documentation == doc.help
        assert getattr(m, doc.attr) is not None
    # prometheus_client also exposes <name>_created timestamps as separate families
    ours = {name for name in families if not name.endswith("_created")}
    assert ours == {doc.base_name for doc in METRIC_DOCS}


def test_names_follow_prometheus_conventions() -> None:
    for doc in METRIC_DOCS:
        assert doc.name.startswith("kvd_")
        assert (doc.type == "counter") == doc.name.endswith("_total"), doc.name
        if doc.type == "histogram":
            assert doc.name.endswith("_seconds")
            assert list(doc.buckets) == sorted(doc.buckets)
        assert doc.help.strip() and len(doc.help) > 20
        for label in doc.labels:
            assert label not in ("request_id", "block_id", "engine_id")


def test_transfer_buckets_span_100us_to_60s() -> None:
    doc = next(d for d in METRIC_DOCS if d.attr == "transfer_duration")
    assert doc.buckets[0] == pytest.approx(0.0001) and doc.buckets[-1] == 60.0


def test_values_after_increments() -> None:
    m = Metrics()
    m.transfer_finished("consumer", "ok", 4096, 0.003)
    m.transfer_finished("consumer", "ok", 1024, 0.2)
    m.transfer_finished("consumer", "failed", 999, 0.5)
    m.transfer_finished("producer", "expired", 0, 30.0)
    m.descriptors_posted.inc(12)
    m.post_duration.observe(0.0004)
    m.handshakes.labels(outcome="timeout").inc()
    m.handshake_duration.observe(0.01)
    m.protocol_error("engine", "decode")
    m.protocol_error("peer", "nonsense-reason")
    m.auth_failures.labels(face="peer").inc(2)
    m.inflight_transfers.set(3)
    m.held_requests.inc()
    m.pool_bytes.set(1 << 30)
    m.plan_cache_hits.inc()
    m.plan_cache_misses.inc(2)
    s = scrape(m.registry)
    remote = ("path", "remote")
    assert s[("kvd_transfers_total", (("outcome", "ok"), remote, ("role", "consumer")))] == 2
    assert s[("kvd_transfers_total", (("outcome", "failed"), remote, ("role", "consumer")))] == 1
    assert s[("kvd_transfers_total", (("outcome", "expired"), remote, ("role", "producer")))] == 1
    # failed pulls do not count as delivered bytes
    assert s[("kvd_transferred_bytes_total", (remote, ("role", "consumer")))] == 5120
    assert s[("kvd_transfer_duration_seconds_count", (remote, ("role", "consumer")))] == 3
    assert s[("kvd_transfer_duration_seconds_bucket",
              (("le", "0.005"), remote, ("role", "consumer")))] == 1
    assert s[("kvd_transfer_duration_seconds_sum", (remote, ("role", "consumer")))] == \
        pytest.approx(0.703)
    assert s[("kvd_descriptors_posted_total", ())] == 12
    assert s[("kvd_transfer_post_duration_seconds_count", ())] == 1
    assert s[("kvd_handshakes_total", (("outcome", "timeout"),))] == 1
    assert s[("kvd_handshakes_total", (("outcome", "ok"),))] == 0
    assert s[("kvd_protocol_errors_total", (("face", "engine"), ("reason", "decode")))] == 1
    assert s[("kvd_protocol_errors_total", (("face", "peer"), ("reason", "decode")))] == 1
    assert s[("kvd_auth_failures_total", (("face", "peer"),))] == 2
    assert s[("kvd_inflight_transfers", ())] == 3
    assert s[("kvd_held_requests", ())] == 1
    assert s[("kvd_pool_registered_bytes", ())] == 1 << 30
    assert s[("kvd_plan_cache_hits_total", ())] == 1
    assert s[("kvd_plan_cache_misses_total", ())] == 2
    assert s[("kvd_build_info", (("version", kvd.__version__),))] == 1


def test_bounded_label_children_exist_before_first_event() -> None:
    s = scrape(Metrics().registry)
    for role in ("producer", "consumer"):
        for outcome in ("ok", "failed", "expired", "cancelled"):
            key = (("outcome", outcome), ("path", "remote"), ("role", role))
            assert s[("kvd_transfers_total", key)] == 0


def test_two_daemons_in_one_process_keep_separate_registries() -> None:
    a, b = Metrics(), Metrics(CollectorRegistry())
    a.leases_expired.inc()
    assert scrape(a.registry)[("kvd_leases_expired_total", ())] == 1
    assert scrape(b.registry)[("kvd_leases_expired_total", ())] == 0


def test_metric_names_include_histogram_series() -> None:
    names = metric_names()
    assert "kvd_transfer_duration_seconds_bucket" in names
    assert "kvd_transfers_total" in names
    scraped = {name for name, _ in scrape(Metrics().registry)}
    assert scraped - {n for n in scraped if n.endswith("_created")} <= names

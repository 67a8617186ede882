"""Metrics: names, labels and values as Prometheus sees them (parsed exposition).

Also the logging setup (kvd.ops.logsetup), the other operator-facing output.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvd
from kvd.ops.logsetup import RateLimitFilter, configure_logging
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


# --- logging (kvd.ops.logsetup): lives here until it gets its own test module -----------------


@pytest.fixture(autouse=True)
def _restore_kvd_logger() -> Iterator[None]:
    """configure_logging mutates the process-wide 'kvd' logger; put it back so other
    tests (caplog) see kvd records as before."""
    logger = logging.getLogger("kvd")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        if handler not in saved[0]:
            logger.removeHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if line]


def test_json_lines_carry_context_fields() -> None:
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    log = logging.getLogger("kvd.daemon")
    log.warning(
        "pull failed: %s",
        "peer gone",
        extra={"request_id": "r1", "engine_id": "decode-0", "peer": "tcp://10.0.0.2:7101"},
    )
    log.debug("not shown at info")
    (line,) = _lines(stream)
    obj = json.loads(line)
    assert obj["level"] == "warning" and obj["logger"] == "kvd.daemon"
    assert obj["msg"] == "pull failed: peer gone"
    assert (obj["request_id"], obj["engine_id"], obj["peer"]) == (
        "r1",
        "decode-0",
        "tcp://10.0.0.2:7101",
    )
    assert obj["ts"].endswith("+00:00")


def test_json_exception_and_text_format() -> None:
    stream = io.StringIO()
    configure_logging("json", "debug", stream=stream)
    try:
        raise ValueError("bad geometry")
    except ValueError:
        logging.getLogger("kvd").exception("register refused", extra={"engine_id": "p0"})
    obj = json.loads(_lines(stream)[0])
    assert "ValueError: bad geometry" in obj["exc"]

    stream = io.StringIO()
    configure_logging("text", "info", stream=stream)
    logging.getLogger("kvd.peer").error("handshake timeout", extra={"peer": "tcp://h:7101"})
    (line,) = _lines(stream)
    assert "ERROR" in line and "kvd.peer: handshake timeout" in line
    assert line.endswith("peer=tcp://h:7101")


def test_reconfigure_does_not_duplicate_lines() -> None:
    stream = io.StringIO()
    configure_logging("text", "info")
    configure_logging("text", "info", stream=stream)
    logging.getLogger("kvd").info("once")
    assert len(_lines(stream)) == 1


def test_bad_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError):
        configure_logging("xml", "info")
    with pytest.raises(ValueError):
        configure_logging("text", "loud")


def test_repeated_warnings_are_rate_limited_then_summarised() -> None:
    clock, stream = FakeClock(), io.StringIO()
    configure_logging("json", "info", stream=stream, burst=3, interval_s=10.0, clock=clock)
    log = logging.getLogger("kvd.daemon")
    for i in range(50):  # same template, different arguments: one storm
        log.warning("pull %s failed", f"r{i}", extra={"request_id": f"r{i}"})
    for i in range(5):  # info is never limited
        log.info("published %s", i)
    log.warning("another template")  # separate key, not suppressed
    lines = [json.loads(x) for x in _lines(stream)]
    storm = [x for x in lines if x["msg"].startswith("pull ")]
    assert [x["request_id"] for x in storm] == ["r0", "r1", "r2"]
    assert sum(x["level"] == "info" for x in lines) == 5
    assert any(x["msg"] == "another template" for x in lines)

    clock.now += 9.9  # still inside the window
    log.warning("pull %s failed", "r50")
    assert len(_lines(stream)) == len(lines)

    clock.now += 0.2  # window rolled over: next line reports what was dropped
    log.warning("pull %s failed", "r51")
    last = json.loads(_lines(stream)[-1])
    assert last["suppressed"] == 48
    assert last["msg"] == "pull r51 failed (suppressed 48 similar messages)"


def test_rate_limit_filter_flush_reports_pending() -> None:
    clock = FakeClock()
    flt = RateLimitFilter(burst=1, interval_s=5.0, clock=clock)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("kvd.x", logging.ERROR, __file__, 1, msg, None, None)

    assert [flt.filter(record("boom")) for _ in range(4)] == [True, False, False, False]
    assert flt.flush_suppressed() == [(("kvd.x", "boom"), 3)]
    assert flt.flush_suppressed() == []

"""Prometheus metrics of one kvd daemon.

Every metric lives on the registry handed to :class:`Metrics` (or a fresh one),
never on prometheus_client's global default: tests run several daemons in one
process and each must scrape only its own numbers. The metrics are built from the
table in :mod:`kvd.ops.metric_docs` (``METRIC_DOCS``), which also renders
``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import kvd
from kvd.ops.metric_docs import (
    CURVE_REASONS,
    FACES,
    HANDSHAKE_OUTCOMES,
    METRIC_DOCS,
    PROTOCOL_REASONS,
    ROLES,
    TRANSFER_OUTCOMES,
    MetricDoc,
)
from kvd.transport.base import PostTiming


class Metrics:
    """All metrics of one daemon, as attributes named by ``METRIC_DOCS[i].attr``.

    Labelled children of the bounded label sets are created up front so that a
    counter reads 0 rather than being absent before its first event: an absent
    series makes ``rate()`` and alert expressions silently empty.
    """

    transfers: Counter
    transferred_bytes: Counter
    transfer_duration: Histogram
    post_duration: Histogram
    descriptors_posted: Counter
    post_build_per_descriptor: Histogram
    posting_duration: Histogram
    loop_lag: Histogram
    loop_held: Histogram
    handshakes: Counter
    handshake_duration: Histogram
    leases_expired: Counter
    notifications_failed: Counter
    invalid_blocks: Counter
    protocol_errors: Counter
    auth_failures: Counter
    curve_refusals: Counter
    curve_allowlist_keys: Gauge
    busy_rejections: Counter
    events_dropped: Counter
    inflight_transfers: Gauge
    rail_reads: Counter
    rail_bytes: Counter
    quarantined_pulls: Gauge
    quarantined_bytes: Gauge
    held_requests: Gauge
    pool_bytes: Gauge
    pool_page_bytes: Gauge
    engines: Gauge
    peers: Gauge
    plan_cache_hits: Counter
    plan_cache_misses: Counter
    build_info: Gauge

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # The next transfer_finished's exemplar ({"trace_id": ...}), set by kvd.ops.otel for
        # a traced request; shown in the OpenMetrics exposition only.
        self.exemplar: dict[str, str] | None = None
        for doc in METRIC_DOCS:
            setattr(self, doc.attr, _make(doc, self.registry))
        for role in ROLES:  # remote: every deployment has it; local appears when used
            self.transferred_bytes.labels(role=role, path="remote")
            self.transfer_duration.labels(role=role, path="remote")
            for outcome in TRANSFER_OUTCOMES:
                self.transfers.labels(role=role, path="remote", outcome=outcome)
        for outcome in HANDSHAKE_OUTCOMES:
            self.handshakes.labels(outcome=outcome)
        for face in FACES:
            self.auth_failures.labels(face=face)
            for reason in CURVE_REASONS:
                self.curve_refusals.labels(face=face, reason=reason)
            for reason in PROTOCOL_REASONS:
                self.protocol_errors.labels(face=face, reason=reason)
        self.build_info.labels(version=kvd.__version__).set(1)
        self._rails_seen: dict[tuple[int, str], tuple[int, int]] = {}
        self._transfer_children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}

    def transfer_finished(self, role: str, outcome: str, nbytes: int, duration_s: float,
                          path: str = "remote") -> None:
        """Record one finished request in the three transfer metrics at once.

        Bytes count only for ``ok``: a failed pull's partial reads were not
        delivered to the engine, so counting them would overstate throughput.
        ``path``: "local" when the bytes were copied inside this daemon (both engines
        registered here), "host" when copied from another daemon's pool files mapped here
        (consumer side), "remote" when they crossed to or from another daemon.
        """
        key = (role, path, outcome)
        children = self._transfer_children.get(key)
        if children is None:  # labels() costs a few µs a call: once per label set
            children = self._transfer_children[key] = (
                self.transfers.labels(role=role, path=path, outcome=outcome),
                self.transferred_bytes.labels(role=role, path=path),
                self.transfer_duration.labels(role=role, path=path))
        count, moved, duration = children
        count.inc()
        if outcome == "ok" and nbytes:
            moved.inc(nbytes)
        if self.exemplar is None:
            duration.observe(duration_s)
        else:  # a traced request's (kvd.ops.otel sets it just before): its trace id
            duration.observe(duration_s, self.exemplar)
            self.exemplar = None

    def reads_posted(self, timings: Iterable[PostTiming | None]) -> float:
        """Record one pull's posted READs: build time per descriptor of each, and their
        total build time (``posting_duration``, also returned)."""
        total_s = 0.0
        for t in timings:
            if t is None:
                continue
            total_s += t.build_s
            if t.descriptors:
                self.post_build_per_descriptor.observe(t.build_s / t.descriptors)
        self.posting_duration.observe(total_s)
        return total_s

    def rails_seen(self, totals: Iterable[tuple[int, str, int, int]]) -> None:
        """Bring the per-worker counters up to the workers' running totals (worker, rail,
        reads, bytes): the transport counts on the NIXL thread, this runs on the loop."""
        for worker, rail, reads, nbytes in totals:
            labels = {"worker": str(worker), "rail": rail or "any"}
            key = (worker, rail)
            seen_reads, seen_bytes = self._rails_seen.get(key, (0, 0))
            if reads > seen_reads:
                self.rail_reads.labels(**labels).inc(reads - seen_reads)
            else:
                self.rail_reads.labels(**labels)
            if nbytes > seen_bytes:
                self.rail_bytes.labels(**labels).inc(nbytes - seen_bytes)
            self._rails_seen[key] = (max(reads, seen_reads), max(nbytes, seen_bytes))

    def protocol_error(self, face: str, reason: str) -> None:
        """Count a rejected message; an unexpected reason is folded into 'decode'
        rather than minting a new series."""
        if reason not in PROTOCOL_REASONS:
            reason = "decode"
        self.protocol_errors.labels(face=face, reason=reason).inc()


def _make(doc: MetricDoc, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    if doc.type == "counter":
        return Counter(doc.base_name, doc.help, doc.labels, registry=registry)
    if doc.type == "gauge":
        return Gauge(doc.base_name, doc.help, doc.labels, registry=registry)
    if doc.type == "histogram":
        return Histogram(
            doc.base_name, doc.help, doc.labels, registry=registry, buckets=doc.buckets
        )
    raise ValueError(f"unknown metric type {doc.type!r} for {doc.name}")

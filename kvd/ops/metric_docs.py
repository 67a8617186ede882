"""The table of every Prometheus metric kvd exports: name, type, labels, help.

This table is the single source of truth: :class:`kvd.ops.metrics.Metrics` builds its
metrics from it and ``scripts/gen_docs.py`` renders ``docs/metrics.md`` from it, so
the reference cannot drift from the code.

Labels are bounded enums only (role, outcome, face, reason): a per-request or
per-block label would make the series count grow with traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

# 100 µs .. 60 s, roughly x2.5 per step: a 1-block pull on loopback lands in the
# first buckets, a multi-GiB hetero pull over a slow link in the last ones.
TRANSFER_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Posting is CPU work (plan lookup, descriptor build, one NIXL call): µs to tens of ms.
POST_BUCKETS: tuple[float, ...] = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
)
# Handshakes are bounded by handshake_timeout_s (default 5 s).
# Seconds per descriptor to build a READ's NIXL request (prepared lists: well under
# a microsecond; fresh lists: a few microseconds).
PER_DESCRIPTOR_BUCKETS: tuple[float, ...] = (
    1e-8, 3e-8, 1e-7, 3e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4,
)

HANDSHAKE_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# How late the event loop wakes: well under 1 ms when nothing holds it; the engine
# face's budget for a Ping or Poll is 50 ms (an engine step must never wait longer).
LOOP_LAG_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)

ROLES = ("producer", "consumer")
TRANSFER_OUTCOMES = ("ok", "failed", "expired", "cancelled")
HANDSHAKE_OUTCOMES = ("ok", "failed", "timeout", "refused")
FACES = ("engine", "peer")
PROTOCOL_REASONS = ("decode", "unknown", "version", "limit")
CURVE_REASONS = ("unknown_key", "plaintext", "handshake", "revoked")


@dataclass(frozen=True)
class MetricDoc:
    """One metric as documented: the exposition name (with ``_total`` for counters)."""

    attr: str
    name: str
    type: str  # counter | gauge | histogram | info
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()

    @property
    def base_name(self) -> str:
        """The name prometheus_client expects (it appends ``_total`` itself)."""
        return self.name[: -len("_total")] if self.type == "counter" else self.name


METRIC_DOCS: tuple[MetricDoc, ...] = (
    MetricDoc(
        "transfers",
        "kvd_transfers_total",
        "counter",
        ("role", "path", "outcome"),
        "Requests finished, by role (producer: a held request released; consumer: a pull "
        "completed), path (local: copied inside this daemon, both engines registered here; "
        "host: copied from another daemon's pool files mapped here, that daemon on this host; "
        "remote: read across daemons over NIXL) and outcome (ok, failed, expired, "
        "cancelled).",
    ),
    MetricDoc(
        "transferred_bytes",
        "kvd_transferred_bytes_total",
        "counter",
        ("role", "path"),
        "Bytes of KV cache moved by finished transfers (consumer: read into local pools; "
        "producer: read out of local pools by peers), by path (local, host or remote).",
    ),
    MetricDoc(
        "transfer_duration",
        "kvd_transfer_duration_seconds",
        "histogram",
        ("role", "path"),
        "Time from a pull being accepted (consumer) or a request being published (producer) "
        "until it finished, whatever the outcome, by path (local, host or remote).",
        TRANSFER_BUCKETS,
    ),
    MetricDoc(
        "post_duration",
        "kvd_transfer_post_duration_seconds",
        "histogram",
        (),
        "Time to look up the plan, build the descriptor lists and post the NIXL READs of one pull.",
        POST_BUCKETS,
    ),
    MetricDoc(
        "descriptors_posted",
        "kvd_descriptors_posted_total",
        "counter",
        (),
        "NIXL descriptors (coalesced byte ranges) posted in READs.",
    ),
    MetricDoc(
        "post_build_per_descriptor",
        "kvd_post_build_per_descriptor_seconds",
        "histogram",
        (),
        "Per READ: time to build its NIXL request (prepared-list indices or a fresh list) "
        "divided by its descriptors as posted (before NIXL merges adjacent ones).",
        PER_DESCRIPTOR_BUCKETS,
    ),
    MetricDoc(
        "posting_duration",
        "kvd_pull_posting_seconds",
        "histogram",
        (),
        "Per pull: time spent building its NIXL requests (all its READs). The posting share "
        "of pulls is its _sum over kvd_transfer_duration_seconds_sum{role=\"consumer\"}.",
        POST_BUCKETS,
    ),
    MetricDoc(
        "loop_lag",
        "kvd_event_loop_lag_seconds",
        "histogram",
        (),
        "How much later than asked the daemon's event loop ran a 10 ms timer: the time a "
        "callback held the loop, which every engine's Ping and Poll waited too. Its p99 "
        "should stay well under 50 ms.",
        LOOP_LAG_BUCKETS,
    ),
    MetricDoc(
        "loop_held",
        "kvd_event_loop_held_seconds",
        "histogram",
        (),
        "The part of each kvd_event_loop_lag_seconds sample that the daemon caused: the "
        "lateness less the time the kernel kept the loop's thread waiting for a CPU "
        "(schedstat run delay; Linux). High lag with low held time: the host or the pod's "
        "CPU limit starved kvd. High held time: a callback of kvd held the loop (a bug).",
        LOOP_LAG_BUCKETS,
    ),
    MetricDoc(
        "handshakes",
        "kvd_handshakes_total",
        "counter",
        ("outcome",),
        "Peer handshakes initiated, by outcome (ok, failed, timeout, refused).",
    ),
    MetricDoc(
        "handshake_duration",
        "kvd_handshake_duration_seconds",
        "histogram",
        (),
        "Round trip of peer handshakes that got an answer.",
        HANDSHAKE_BUCKETS,
    ),
    MetricDoc(
        "leases_expired",
        "kvd_leases_expired_total",
        "counter",
        (),
        "Held requests released because their lease ran out before every reader finished.",
    ),
    MetricDoc(
        "notifications_failed",
        "kvd_notifications_failed_total",
        "counter",
        (),
        "NIXL notifications that could not be sent or were malformed on arrival.",
    ),
    MetricDoc(
        "invalid_blocks",
        "kvd_invalid_blocks_total",
        "counter",
        (),
        "Local block ids reported invalid to engines after a failed or cancelled pull.",
    ),
    MetricDoc(
        "protocol_errors",
        "kvd_protocol_errors_total",
        "counter",
        ("face", "reason"),
        "Messages rejected, by face (engine, peer) and reason (decode: malformed; unknown: "
        "unknown type or not accepted on this face; version: protocol version mismatch; "
        "limit: header over its size or nesting bound).",
    ),
    MetricDoc(
        "auth_failures",
        "kvd_auth_failures_total",
        "counter",
        ("face",),
        "Messages refused for a missing or wrong token, by face (checked from the header, "
        "before the body is decoded).",
    ),
    MetricDoc(
        "curve_refusals",
        "kvd_curve_refusals_total",
        "counter",
        ("face", "reason"),
        "Connections or messages a CURVE face refused: unknown_key (not in the allowlist), "
        "plaintext (no CURVE), handshake (a replayed or forged handshake), revoked (a key "
        "removed from the allowlist: its connections closed).",
    ),
    MetricDoc(
        "curve_allowlist_keys",
        "kvd_curve_allowlist_keys",
        "gauge",
        ("face",),
        "Public keys in the face's CURVE allowlist, as last (re)loaded.",
    ),
    MetricDoc(
        "busy_rejections",
        "kvd_busy_rejections_total",
        "counter",
        (),
        "Registrations, publishes and pulls refused with 'busy' because a bounded table was "
        "full (max_engines, max_held_requests, max_inflight_pulls).",
    ),
    MetricDoc(
        "events_dropped",
        "kvd_events_dropped_total",
        "counter",
        (),
        "Completion events dropped because their engine never polled and its queue was full "
        "(the oldest goes first).",
    ),
    MetricDoc(
        "inflight_transfers",
        "kvd_inflight_transfers",
        "gauge",
        (),
        "Pulls accepted and not yet finished (queued, handshaking or reading).",
    ),
    MetricDoc(
        "rail_reads",
        "kvd_rail_reads_total",
        "counter",
        ("worker", "rail"),
        "READs (parts of pulls) posted by each posting worker; rail: its network device, "
        "'any' for UCX's choice. Absent with a single agent (posting_workers=1, no rails).",
    ),
    MetricDoc(
        "rail_bytes",
        "kvd_rail_read_bytes_total",
        "counter",
        ("worker", "rail"),
        "Bytes of the READs each posting worker posted (kvd_rail_reads_total's).",
    ),
    MetricDoc(
        "quarantined_pulls",
        "kvd_quarantined_pulls",
        "gauge",
        (),
        "Failing pulls not reported yet because a READ of theirs may still land (the "
        "transport has not completed or failed it): their blocks are not handed back.",
    ),
    MetricDoc(
        "quarantined_bytes",
        "kvd_quarantined_bytes",
        "gauge",
        (),
        "Bytes of the quarantined pulls (kvd_quarantined_pulls); past max_quarantined_bytes "
        "new pulls fail busy.",
    ),
    MetricDoc(
        "held_requests",
        "kvd_held_requests",
        "gauge",
        (),
        "Published requests whose blocks are held for remote readers.",
    ),
    MetricDoc(
        "pool_bytes",
        "kvd_pool_registered_bytes",
        "gauge",
        (),
        "Bytes of KV pool memory allocated by kvd and registered with NIXL.",
    ),
    MetricDoc(
        "pool_page_bytes",
        "kvd_pool_page_bytes",
        "gauge",
        (),
        "Smallest page size among live DRAM pools (4096: some pool is on 4 KiB pages, READs "
        "are slower; 2097152: all on 2 MiB huge pages; 0: no DRAM pool).",
    ),
    MetricDoc(
        "engines",
        "kvd_engines_registered",
        "gauge",
        (),
        "Engine ranks currently registered on the engine face.",
    ),
    MetricDoc(
        "peers",
        "kvd_peers_connected",
        "gauge",
        (),
        "Peer daemons with a completed handshake (NIXL metadata loaded).",
    ),
    MetricDoc(
        "plan_cache_hits",
        "kvd_plan_cache_hits_total",
        "counter",
        (),
        "Pulls that reused a cached transfer plan for their engine pair.",
    ),
    MetricDoc(
        "plan_cache_misses",
        "kvd_plan_cache_misses_total",
        "counter",
        (),
        "Pulls that had to compute a transfer plan for their engine pair.",
    ),
    MetricDoc(
        "build_info",
        "kvd_build_info",
        "gauge",
        ("version",),
        "Always 1; the version label is the running kvd version.",
    ),
)


def metric_names() -> set[str]:
    """Every series name a scrape can contain (histogram parts included), so that
    dashboards and alerts can be checked against it."""
    names: set[str] = set()
    for doc in METRIC_DOCS:
        names.add(doc.name)
        if doc.type == "histogram":
            names.update(f"{doc.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
    return names

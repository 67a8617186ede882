"""kvd's transfers in vLLM's own connector stats: its logs and its /metrics.

The rank-0 worker turns the daemon's completion events into one small dict a
step; vLLM aggregates, logs ``KV Transfer metrics: ...`` and feeds the
Prometheus hooks below. kvd's own /metrics show the same transfers from the
daemons' side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvd.integrations.connector_core.events import TransferTotals

_KEYS = ("pulls_ok", "pulls_failed", "sends_ok", "sends_expired", "nbytes", "descriptors",
         "duration_s")


def totals_to_dict(t: TransferTotals) -> dict[str, Any]:
    return {"pulls_ok": t.pulls_ok, "pulls_failed": t.pulls_failed, "sends_ok": t.sends_ok,
            "sends_expired": t.sends_expired, "nbytes": t.nbytes,
            "descriptors": t.descriptors, "duration_s": t.duration_s,
            "durations_s": list(t.durations_s)}


@dataclass
class KvdConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _KEYS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        self.data["durations_s"] = (list(self.data.get("durations_s", []))
                                    + list(other.data.get("durations_s", [])))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        pulls = d.get("pulls_ok", 0)
        seconds = d.get("duration_s", 0.0)
        return {
            "kvd_pulls": pulls,
            "kvd_pulls_failed": d.get("pulls_failed", 0),
            "kvd_sends": d.get("sends_ok", 0),
            "kvd_sends_expired": d.get("sends_expired", 0),
            "kvd_MB": round(d.get("nbytes", 0) / 1e6, 3),
            "kvd_descriptors": d.get("descriptors", 0),
            "kvd_avg_pull_ms": round(1e3 * seconds / pulls, 3) if pulls else 0.0,
            "kvd_GBps": round(d.get("nbytes", 0) / seconds / 1e9, 3) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _KEYS[:4])


class KvdPromMetrics(KVConnectorPromMetrics):
    """vllm:kvd_* counters and a pull duration histogram, per engine label."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, Any]:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

        self.pulls = counter("vllm:kvd_pulls",
                             "kvd pulls that completed ok (failed: vllm:kvd_pulls_failed)")
        self.failed = counter("vllm:kvd_pulls_failed", "kvd pulls that failed or timed out")
        self.sends = counter("vllm:kvd_sends", "published requests released after reads")
        self.expired = counter("vllm:kvd_sends_expired",
                               "published requests released by lease expiry")
        self.nbytes = counter("vllm:kvd_pulled_bytes", "bytes kvd pulled into this engine")
        self.descriptors = counter("vllm:kvd_descriptors",
                                   "NIXL descriptors kvd posted for this engine's pulls")
        hist = self._histogram_cls(
            name="vllm:kvd_pull_duration_seconds", documentation="kvd pull duration",
            labelnames=labelnames,
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5])
        self.duration = {i: hist.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        self.pulls[engine_idx].inc(d.get("pulls_ok", 0))
        self.failed[engine_idx].inc(d.get("pulls_failed", 0))
        self.sends[engine_idx].inc(d.get("sends_ok", 0))
        self.expired[engine_idx].inc(d.get("sends_expired", 0))
        self.nbytes[engine_idx].inc(d.get("nbytes", 0))
        self.descriptors[engine_idx].inc(d.get("descriptors", 0))
        for seconds in d.get("durations_s", []):
            self.duration[engine_idx].observe(seconds)

"""kvd's transfers in vLLM's connector stats: what the log line and /metrics get."""

from __future__ import annotations

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvd.integrations.connector_core.events import EventBook  # noqa: E402
from kvd.integrations.vllm.connector import KvdConnector  # noqa: E402
from kvd.integrations.vllm.stats import totals_to_dict  # noqa: E402
from kvd.wire.protocol import Event  # noqa: E402

pytestmark = pytest.mark.vllm


def _worker_stats(pulls: list[tuple[bool, int, int, float]]) -> dict:
    book = EventBook()
    for i, (ok, nbytes, descriptors, seconds) in enumerate(pulls):
        book.announce_recv(f"r{i}", [i], deadline_s=1e9)
        book.on_event(Event(kind="done_recving", request_id=f"r{i}", ok=ok, nbytes=nbytes,
                            descriptors=descriptors, duration_s=seconds,
                            invalid_block_ids=[] if ok else [i]))
    return totals_to_dict(book.take_totals())


def test_stats_aggregate_across_steps_and_reduce_to_the_log_line() -> None:
    a = KvdConnector.build_kv_connector_stats(_worker_stats([(True, 4_000_000, 100, 0.002)]))
    b = KvdConnector.build_kv_connector_stats(_worker_stats([(True, 2_000_000, 50, 0.001),
                                                             (False, 0, 0, 0.5)]))
    assert a is not None and b is not None and not a.is_empty()
    line = a.aggregate(b).reduce()
    assert line["kvd_pulls"] == 2 and line["kvd_pulls_failed"] == 1
    assert line["kvd_MB"] == 6.0 and line["kvd_descriptors"] == 150
    assert line["kvd_avg_pull_ms"] == pytest.approx(1.5)
    assert line["kvd_GBps"] == pytest.approx(2.0)
    assert KvdConnector.build_kv_connector_stats({}).is_empty()


def test_prometheus_hooks_count_what_the_stats_carry() -> None:
    registry = CollectorRegistry()

    def make(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(
            self, *a, registry=registry, **k)})

    types = {Counter: make(Counter), Gauge: make(Gauge), Histogram: make(Histogram)}

    class _Cfg:
        kv_transfer_config = None

    prom = KvdConnector.build_prom_metrics(_Cfg(), types, ["engine"], {0: ["0"]})
    prom.observe(_worker_stats([(True, 1000, 7, 0.003), (True, 500, 3, 0.004)]), 0)
    assert registry.get_sample_value("vllm:kvd_pulls_total", {"engine": "0"}) == 2
    assert registry.get_sample_value("vllm:kvd_pulled_bytes_total", {"engine": "0"}) == 1500
    assert registry.get_sample_value("vllm:kvd_descriptors_total", {"engine": "0"}) == 10
    assert registry.get_sample_value("vllm:kvd_pull_duration_seconds_count",
                                     {"engine": "0"}) == 2

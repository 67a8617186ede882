"""Page size of the pools where operators look: `kvd status`, /metrics, posting metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvd.config import Config, validate
from kvd.errors import ConfigError
from kvd.ops.metrics import Metrics
from kvd.ops.status import format_status
from kvd.transport.base import PostTiming
from kvd.wire.protocol import RankStatus, Status


def _rank(page_bytes: int, backing: str) -> RankStatus:
    return RankStatus(engine_id="e", rank="tp0pp0", tp_size=1, pp_size=1, pool="p",
                      pool_bytes=1 << 20, gone=False, pins=0, page_bytes=page_bytes,
                      backing=backing)


def _status(*ranks: RankStatus) -> Status:
    return Status(daemon_id="d", version="0", draining=False, engines=list(ranks), peers=[],
                  held=[], pulls=[])


def test_status_shows_page_size_and_warns_on_4k() -> None:
    text = format_status(_status(_rank(4096, "shm"), _rank(2 << 20, "memfd_hugetlb")))
    assert "pages 4 KiB (shm)" in text and "pages 2 MiB (memfd_hugetlb)" in text
    assert "WARNING: 1 pool(s) on 4 KiB pages" in text


def test_status_no_warning_on_huge_pages_or_vram() -> None:
    text = format_status(_status(_rank(2 << 20, "hugetlbfs"), _rank(0, "cuda_ipc")))
    assert "WARNING" not in text and "(cuda_ipc)" in text


def test_old_status_replies_decode_without_page_fields() -> None:
    """A daemon from before the fields answers without them: defaults, no warning."""
    r = RankStatus(engine_id="e", rank="tp0pp0", tp_size=1, pp_size=1, pool="p",
                   pool_bytes=1, gone=False, pins=0)
    assert r.page_bytes == 0 and "WARNING" not in format_status(_status(r))


def test_pool_backing_is_validated() -> None:
    assert validate(Config(pool_backing="memfd_hugetlb")).pool_backing == "memfd_hugetlb"
    try:
        validate(Config(pool_backing="thp"))
    except ConfigError as exc:
        assert "pool_backing" in str(exc)
    else:
        raise AssertionError("pool_backing=thp accepted")


def test_reads_posted_records_per_descriptor_and_pull_posting_time() -> None:
    m = Metrics()
    total_s = m.reads_posted([PostTiming(descriptors=1000, build_s=0.002, transfer_s=0.05),
                              None, PostTiming(descriptors=0, build_s=0.0, transfer_s=0.0)])
    assert total_s == 0.002
    text = generate_latest(m.registry).decode()
    assert "kvd_post_build_per_descriptor_seconds_count 1.0" in text
    assert "kvd_pull_posting_seconds_sum 0.002" in text
    assert "kvd_pool_page_bytes 0.0" in text

"""kvd bench's posting figures come from deltas of the decode daemon's
/metrics over the timed pulls only (the warm-up and other scenarios are excluded)."""

from __future__ import annotations

from kvd.tools.bench.e2e import posting_delta


def test_posting_delta_per_descriptor_per_pull_and_share() -> None:
    before = (1000.0, 0.010, 2.0, 1.0, 4096.0)
    after = (1000.0 + 5 * 256, 0.010 + 5 * 0.0004, 7.0, 1.0 + 5 * 0.1, 2097152.0)
    out = posting_delta(before, after)
    assert out["kvd_post_us_per_descriptor"] == round(0.002 / 1280 * 1e6, 3)
    assert out["kvd_post_ms_per_pull"] == 0.4
    assert out["kvd_posting_share"] == round(0.002 / 0.5, 4)
    assert out["kvd_pool_page_bytes"] == 2097152


def test_posting_delta_without_pulls_is_none_not_a_division_error() -> None:
    same = (5.0, 0.1, 1.0, 2.0, 0.0)
    out = posting_delta(same, same)
    assert out["kvd_post_us_per_descriptor"] is None and out["kvd_posting_share"] is None

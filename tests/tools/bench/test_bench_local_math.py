"""The local bench scenario's arithmetic, without daemons: memcpy/pull alternation,
medians of ratios, latency percentiles and which targets a run met."""

from __future__ import annotations

import pytest

from kvd.tools.bench.local import (
    TARGET_LOCAL_FRAGMENTED,
    TARGET_LOCAL_HETERO,
    alternated_ratios,
    local_targets,
    local_verified,
    render_local,
    summarize_latency,
    summarize_throughput,
)

MiB = 1 << 20


def test_each_pull_is_compared_with_the_memcpys_either_side_of_it() -> None:
    # memcpy 40 ms, pull 50 ms: 0.8x; memcpys of 40 and 60 ms around a 50 ms pull: 1.0x
    assert alternated_ratios([0.04, 0.04], [0.05]) == pytest.approx([0.8])
    assert alternated_ratios([0.04, 0.06, 0.02], [0.05, 0.08]) == pytest.approx([1.0, 0.5])


@pytest.mark.parametrize("memcpy_s, pull_s", [([0.04], [0.05]), ([0.04, 0.04, 0.04], [0.05]),
                                               ([0.04], []), ([0.04, 0.04], [0.0]),
                                               ([0.0, 0.04], [0.05])])
def test_alternation_needs_a_memcpy_before_and_after_each_pull(memcpy_s, pull_s) -> None:
    with pytest.raises(ValueError):
        alternated_ratios(memcpy_s, pull_s)


def test_the_figure_is_the_median_of_per_pull_ratios_not_a_ratio_of_medians() -> None:
    # a slow memcpy and a slow pull that happened together (a burst of load) cancel out
    memcpy_s = [0.04, 0.04, 0.08, 0.08, 0.04, 0.04]
    pull_s = [0.05, 0.06, 0.10, 0.05, 0.05]
    out = summarize_throughput(512 * MiB, memcpy_s, pull_s, [0.04] * 5)
    ratios = sorted(alternated_ratios(memcpy_s, pull_s))
    assert ratios == pytest.approx(sorted([0.8, 1.0, 0.8, 1.2, 0.8]))
    assert out["ratio_local_memcpy"] == pytest.approx(0.8)  # median of the five
    assert out["ratio_local_memcpy_min"] == pytest.approx(0.8)
    assert out["ratio_local_memcpy_max"] == pytest.approx(1.2)
    # medians of the times alone: 512 MiB / 0.04 s and / 0.05 s
    assert out["memcpy_gbps"] == pytest.approx(13.42, abs=0.01)
    assert out["local_gbps"] == pytest.approx(10.74, abs=0.01)
    assert out["local_daemon_gbps"] == pytest.approx(13.42, abs=0.01)
    assert out["samples"] == 5 and out["local_ms"][2] == 100.0


def test_latency_ratio_is_of_the_p50s() -> None:
    local = [0.0002 * (i + 1) for i in range(100)]   # 0.2 .. 20 ms
    remote = [0.0004 * (i + 1) for i in range(100)]  # 0.4 .. 40 ms
    out = summarize_latency(local, remote, local_daemon_s=[0.0001], remote_daemon_s=[0.0003])
    assert out["local_p50_ms"] == 10.0 and out["two_daemons_p50_ms"] == 20.0
    assert out["local_p99_ms"] == 19.8 and out["two_daemons_p99_ms"] == 39.6
    assert out["ratio_local_two_daemons_p50"] == 0.5
    assert out["local_daemon_p50_ms"] == 0.1 and out["two_daemons_daemon_p50_ms"] == 0.3
    with pytest.raises(ValueError):
        summarize_latency([], remote)


def _row(name: str, ptp: int, dtp: int, threads: int, ratio: float) -> dict:
    return {"name": name, "prefill_tp": ptp, "decode_tp": dtp, "copy_threads": threads,
            "nbytes": 512 * MiB, "memcpy_gbps": 13.0, "local_gbps": 13.0 * ratio,
            "local_daemon_gbps": None, "ratio_local_memcpy": ratio,
            "ratio_local_memcpy_min": ratio, "ratio_local_memcpy_max": ratio,
            "path": "local", "verified": True}


def _local(rows: list[dict], lat_ratio: float | None) -> dict:
    lat = {} if lat_ratio is None else {
        "ratio_local_two_daemons_p50": lat_ratio, "local_p50_ms": 0.3, "local_p99_ms": 0.9,
        "two_daemons_p50_ms": 0.6, "two_daemons_p99_ms": 1.5, "samples": 200,
        "nbytes": 2 * MiB, "verified": True}
    return {"rows": rows, "latency": lat, "repeats": 9}


def test_targets_per_copy_thread_count() -> None:
    f, h = TARGET_LOCAL_FRAGMENTED, TARGET_LOCAL_HETERO
    rows = [_row("local_tp1_tp1", 1, 1, 1, f - 0.01), _row("local_tp1_tp2", 1, 2, 1, h),
            _row("local_tp4_tp2", 4, 2, 1, h + 0.1),
            _row("local_tp1_tp1", 1, 1, 2, f), _row("local_tp1_tp2", 1, 2, 2, h + 0.2),
            _row("local_tp4_tp2", 4, 2, 2, h - 0.01)]
    met = local_targets(_local(rows, 0.5))
    assert met == {"local_fragmented_t1": False, "local_hetero_t1": True,
                   "local_fragmented_t2": True, "local_hetero_t2": False,
                   "local_1block_p50_ratio": True}
    assert local_targets(_local(rows, 0.51))["local_1block_p50_ratio"] is False
    assert local_targets(_local(rows, None))["local_1block_p50_ratio"] is False
    # hetero skipped on purpose: nothing to miss; no homogeneous row: missed
    assert local_targets(_local(rows[:1], 0.4))["local_hetero_t1"] is True
    assert local_targets(_local(rows[1:3], 0.4))["local_fragmented_t1"] is False


def test_verified_needs_every_row_checked_and_local_and_the_latency_checked() -> None:
    rows = [_row("local_tp1_tp1", 1, 1, 2, 1.0)]
    assert local_verified(_local(rows, 0.4))
    assert not local_verified(_local([{**rows[0], "verified": False}], 0.4))
    assert not local_verified(_local([{**rows[0], "path": "remote"}], 0.4))
    assert not local_verified(_local(rows, None))
    assert not local_verified(_local([], 0.4))


def test_render_shows_each_row_and_the_targets() -> None:
    local = _local([_row("local_tp1_tp1", 1, 1, 1, 0.95), _row("local_tp1_tp1", 1, 1, 2, 1.2)],
                   0.45)
    local["targets"] = {"met": local_targets(local)}
    text = render_local(local)
    assert text.count("local_tp1_tp1") == 2 and "0.95" in text and "1.20" in text
    assert "x0.45" in text and "local_1block_p50_ratio: met" in text


def test_bench_exit_code_needs_the_local_bytes_verified(monkeypatch, capsys) -> None:
    import kvd.tools.bench.run as bench

    good = _local([_row("local_tp1_tp1", 1, 1, 2, 1.0)], 0.4)
    fake = {"scenarios": [{"verified": True}], "local": good}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: fake)
    assert bench.main(as_json=True) == 0
    fake["local"] = {**good, "rows": [{**good["rows"][0], "verified": False}]}
    assert bench.main(as_json=True) == 1
    fake["local"] = {**good, "rows": [{**good["rows"][0], "path": "remote"}]}
    assert bench.main(as_json=True) == 1
    capsys.readouterr()

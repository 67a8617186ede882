"""`kvd bench posting|pages|vram`: the subcommands that replaced benchmarks/ scripts run
end to end through the CLI on small buffers, check their bytes, and refuse bad input
with one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KVD = [sys.executable, "-m", "kvd", "bench"]


def _run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*KVD, *args], capture_output=True, text=True, timeout=timeout_s)


def test_bench_posting_measures_and_verifies():
    r = _run("posting", "--nbytes-mib", "4", "--chunks-kib", "32", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["nbytes"] == 4 << 20
    assert res["cases"] and all(c["verified"] for c in res["cases"])


def test_bench_pages_measures_the_kinds_asked_for():
    r = _run("pages", "--nbytes-mib", "4", "--kinds", "anon,shm", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    kinds = {k["kind"] for k in json.loads(r.stdout)["kinds"]}
    assert kinds == {"anon", "shm"}


def test_bench_vram_on_dram_runs_the_same_code_byte_exact():
    r = _run("vram", "--device", "cpu", "--nbytes-mib", "4", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verified"] is True and out["local_verified"] is True
    # both engines on one daemon: the pull was a copy inside it, timed beside the device copy
    assert out["local_paths"] == ["local"] and out["local_gbps"] > 0
    assert out["one_block_local_p50_ms"] > 0 and out["ratio_one_block_local_remote"] > 0
    # judged in the same run: each target's flag follows from the ratios beside it
    met, t = out["targets"]["met"], out["targets"]
    assert met["local_copy"] == (out["ratio_local_copy"] >= t["ratio_local_copy_min"])
    assert met["local_1block"] == (out["ratio_one_block_local_remote"]
                                   <= t["ratio_one_block_local_remote_max"])
    assert met["local_1block_p50"] == (out["one_block_local_p50_ms"]
                                       <= t["one_block_local_p50_ms_max"] == 0.3)


def test_bench_split_measures_whole_and_split_reads_byte_exact():
    r = _run("split", "--sizes-kib", "64,256", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["verified"] is True
    assert {(row["nbytes"], row["parts"]) for row in res["rows"]} == {
        (64 << 10, 1), (64 << 10, 2), (256 << 10, 1), (256 << 10, 2)}


def test_split_threshold_is_where_every_larger_split_wins():
    from kvd.tools.bench.splitting import threshold

    def rows(gains):
        return [{"nbytes": n << 20, "parts": 2, "part_nbytes": n << 19,
                 "speedup_vs_whole": g} for n, g in gains]

    assert threshold(rows([(2, 0.8), (4, 1.15), (8, 1.3), (16, 1.5)])) == 2 << 20
    assert threshold(rows([(2, 1.2), (4, 0.9), (8, 1.3)])) == 4 << 20  # a loss above: later
    assert threshold(rows([(2, 0.5), (4, 0.9)])) is None


@pytest.mark.parametrize(("args", "needle"), [
    (("split", "--sizes-kib", "4,x"), "--sizes-kib must be integers"),
    (("pages", "--kinds", "bogus"), "--kinds: unknown bogus"),
    (("posting", "--chunks-kib", "4,x"), "--chunks-kib must be integers"),
    (("vram", "--device", "tpu"), "--device must be cuda or cpu"),
    (("--plot", "x.png"), "--plot needs --curves"),
])
def test_bench_refuses_bad_input_in_one_line(args, needle):
    r = _run(*args, timeout_s=30)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvd: error: ") and needle in lines[0]

"""`benchmarks/progressive_tail.py`'s table: the issue's tails and their ratio, the
paired tails and theirs, and prefill/plain, per prompt length and daemon layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "progressive_tail.py"


def _module():
    spec = importlib.util.spec_from_file_location("progressive_tail_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(system: str, tail: float | None, paired: float | None,
             prefill: float | None, equal: str = "6/6") -> dict:
    return {"system": system, "ttft_minus_plain_p50_ms": tail,
            "tail_after_prefill_p50_ms": paired, "prefill_vs_plain_p50": prefill,
            "tokens_equal": equal}


def test_ratio_needs_both_and_a_positive_sequential_base():
    pt = _module()
    assert pt.ratio(200.0, 50.0) == 0.25
    assert pt.ratio(None, 50.0) is None and pt.ratio(200.0, None) is None
    assert pt.ratio(-30.0, 50.0) is None  # a negative tail is noise, not a base
    assert pt.ratio(0.0, 50.0) is None
    assert pt.ratio(80.0, 0.0) == 0.0


def test_rows_put_the_issues_tails_beside_the_paired_ones():
    pt = _module()
    result = {"summaries": [
        _summary("plain", None, None, None),
        _summary("kvd-1d", -40.0, 120.0, 0.97),  # the plain engine's noise: negative
        _summary("kvd-1d-prog", 310.0, 30.0, 1.01),
        _summary("kvd-2d-nixl", 400.0, 160.0, 0.95, "5/6"),
        _summary("kvd-2d-nixl-prog", 100.0, 40.0, 1.2)]}
    one, two = pt.rows(4096, result)
    assert dict(zip(pt.COLUMNS, one, strict=True)) == {
        "prompt": 4096, "daemons": "one daemon", "sequential tail ms": -40.0,
        "progressive tail ms": 310.0, "ratio": None, "sequential paired ms": 120.0,
        "progressive paired ms": 30.0, "paired ratio": 0.25, "prefill/plain seq": 0.97,
        "prefill/plain prog": 1.01, "tokens equal": "6/6 / 6/6"}
    assert two[4] == 0.25 and two[7] == 0.25 and two[9] == 1.2
    assert two[10] == "5/6 / 6/6"
    text = pt.table({4096: result, 8192: {"error": "exit 1"}})
    lines = text.splitlines()
    assert lines[0].startswith("| prompt | daemons | sequential tail ms")
    assert "paired ratio" in lines[0]
    assert lines[2] == ("| 4096 | one daemon | -40.0 | 310.0 | - | 120.0 | 30.0 | 0.25 | "
                        "0.97 | 1.01 | 6/6 / 6/6 |")
    assert lines[-1].startswith("| 8192 | (failed: see its log) | -")


def test_a_run_without_traces_shows_dashes_for_the_paired_columns():
    pt = _module()
    result = {"summaries": [_summary("kvd-1d", 200.0, None, None),
                            _summary("kvd-1d-prog", 50.0, None, None)]}
    one, two = pt.rows(1024, result)
    assert one[2:8] == [200.0, 50.0, 0.25, None, None, None]
    assert two[2:5] == [None, None, None]  # the layout not in this run


def test_the_model_shape_reaches_kvd_bench_vllm(tmp_path: Path) -> None:
    """--model-shape was accepted and then left out of the command: a kv-heavy run
    measured the default model (16 MiB of KV at 4K tokens instead of 256)."""
    import argparse

    mod = _module()
    args = argparse.Namespace(rounds=6, max_tokens=4, chunk=512, model_shape="kv-heavy",
                              breakdown=False)
    cmd = mod.bench_command(4096, args, tmp_path, tmp_path / "out.json")
    assert cmd[cmd.index("--model-shape") + 1] == "kv-heavy"
    assert cmd[cmd.index("--prompt-tokens") + 1] == "4096" and "--breakdown" in cmd
    assert "--work-dir" not in cmd

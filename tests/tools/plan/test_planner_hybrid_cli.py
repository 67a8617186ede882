"""`kvd plan --hybrid` end to end through the typer app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvd.cli import app
from kvd.planner.hybrid.plan import plan_hybrid
from kvd.planner.topology import Parallelism
from kvd.tools.plan.hybrid_render import PRESETS, load_model, vllm_3read_count

runner = CliRunner()


def invoke(*opts: str):
    single = len(app.registered_commands) == 1 and app.registered_callback is None
    return runner.invoke(app, list(opts) if single else ["plan", *opts])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvd: error: "), result.stderr
    return lines[0]


def test_table_shows_attention_reads_and_the_three_plus_one_mamba_reads():
    result = invoke("--hybrid", "nemotron-h-8b", "--prefill-tp", "4", "--decode-tp", "2",
                    "--tokens", "0")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "attention reads" in out and "Mamba reads" in out and "reads/layer" in out
    mamba = out[out.index("Mamba reads"):out.index("consumers")]
    rows = [line for line in mamba.splitlines() if "<-" in line and "[" in line]
    assert len(rows) == 4 and all(line.split()[-1] == "4" for line in rows)
    assert "descriptors for one request" not in out


def test_json_reads_cover_every_decode_head_and_count_descriptors(tmp_path):
    model = load_model("tiny-hybrid")
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model.to_json()))
    result = invoke("--hybrid", str(path), "--prefill-tp", "2", "--decode-tp", "4",
                    "--tokens", "300", "--block-size", "8", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    heads = model.mamba.num_heads
    got = sorted(h for rank in out["decode_ranks"] for read in rank["mamba_reads"]
                 for h in range(*read["heads"]))
    assert got == list(range(heads))
    desc = out["descriptors"]
    for rank in desc["decode_ranks"]:
        assert rank["total"] == sum(s["attention"] + s["mamba"] for s in rank["sources"]) > 0
        assert rank["vllm_3read"] is not None
    assert out["compat_hash"] and out["consumers"] == {"0/0": 2, "1/0": 2}


def test_vllm_refusals_are_reported_not_counted():
    model = load_model("tiny-hybrid")
    plan = plan_hybrid(model, Parallelism(2), Parallelism(2))
    ids = [[0] for _ in model.groups]
    assert vllm_3read_count(plan, plan.decode_ranks[0], ids, 3, False)[0] is None
    plan = plan_hybrid(model, Parallelism(2, 2), Parallelism(2))
    assert vllm_3read_count(plan, plan.decode_ranks[0], ids, 3, True)[0] is None
    result = invoke("--hybrid", "tiny-hybrid", "--prefill-tp", "2", "--decode-tp", "2",
                    "--block-size", "4", "--decode-block-size", "8")
    assert result.exit_code == 0, result.output
    assert "vLLM: refused (vLLM asserts block_size_ratio == 1" in result.stdout


def test_vllm_count_follows_the_seed_regions():
    """Per source: 2 regions per shared tensor x kernel blocks, 4 per tensor x Mamba slots."""
    model = load_model("nemotron-h-8b")
    plan = plan_hybrid(model, Parallelism(4), Parallelism(2))
    tensors = max(len(g.layers) for g in model.groups)
    att_blocks, ratio = 16, 33
    ids = [list(range(att_blocks)) if model.group_kind(g) == "attention" else [g]
           for g in range(len(model.groups))]
    n_mamba_groups = sum(model.group_kind(g) == "mamba" for g in range(len(model.groups)))
    count, _ = vllm_3read_count(plan, plan.decode_ranks[0], ids, ratio, True)
    sources = 4 // 2
    assert count == sources * (2 * tensors * att_blocks * ratio + 4 * tensors * n_mamba_groups)


def test_hybrid_errors_are_one_line(tmp_path):
    one_head = tmp_path / "one_head.json"
    one_head.write_text(json.dumps({
        "pattern": "M*", "attention": {"num_kv_heads": 1, "head_dim": 8},
        "mamba": {"num_heads": 12, "head_dim": 2, "n_groups": 4, "d_state": 2,
                  "conv_kernel": 4}}))
    assert "decode TP 5 cannot shard 12 SSM heads" in one_line_error(invoke(
        "--hybrid", str(one_head), "--prefill-tp", "4", "--decode-tp", "5"))
    assert "prefill TP 6 cannot shard 4 Mamba groups (B and C" in one_line_error(invoke(
        "--hybrid", str(one_head), "--prefill-tp", "6", "--decode-tp", "2"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not JSON" in one_line_error(invoke("--hybrid", str(bad), "--prefill-tp", "1",
                                               "--decode-tp", "1"))
    assert "presets" in one_line_error(invoke("--hybrid", str(tmp_path / "missing.json"),
                                              "--prefill-tp", "1", "--decode-tp", "1"))
    bad.write_text(json.dumps({**PRESETS["tiny-hybrid"], "pattern": "MX"}))
    assert "unknown letters" in one_line_error(invoke("--hybrid", str(bad), "--prefill-tp", "1",
                                                      "--decode-tp", "1"))
    assert "--kv-heads and --layers are required" in one_line_error(
        invoke("--prefill-tp", "1", "--decode-tp", "1"))


def test_hybrid_plan_path_does_not_import_heavy_modules():
    import subprocess
    import sys

    code = ("import sys, kvd.cli, kvd.tools.plan.hybrid_render; "
            "print(sorted(m for m in ('torch', 'nixl', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_descriptor_counts_follow_the_attention_page_order():
    """vLLM's LBHNC (the default) keeps K||V of a head slice together: about half the
    descriptors of blocks_first for a hetero-TP pull; a cross-layer order is refused."""
    totals = {}
    for layout in ("LBHNC", "blocks_first"):
        result = invoke("--hybrid", "nemotron-h-8b", "--prefill-tp", "4", "--decode-tp", "2",
                        "--tokens", "8192", "--block-size", "16", "--layout", layout, "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)["descriptors"]
        assert report["kv_layout"] == layout
        totals[layout] = report["decode_ranks"][0]["total"]
    assert totals["LBHNC"] < 0.6 * totals["blocks_first"], totals
    line = one_line_error(invoke("--hybrid", "nemotron-h-8b", "--prefill-tp", "4",
                                 "--decode-tp", "2", "--layout", "BHLNC"))
    assert "layer outermost" in line

"""`kvd plan` end to end through the typer app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvd.cli import app

runner = CliRunner()


def invoke(*opts: str):
    # Typer runs a lone command as the app itself; once serve/demo exist, `plan` is a subcommand.
    single = len(app.registered_commands) == 1 and app.registered_callback is None
    return runner.invoke(app, list(opts) if single else ["plan", *opts])


def test_json_has_the_exact_issue_shape():
    result = invoke("--kv-heads", "8", "--layers", "16", "--prefill-tp", "2", "--decode-tp", "1",
                    "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["decode_ranks"] == [{
        "tp_rank": 0, "pp_rank": 0,
        "reads": [
            {"remote_tp_rank": 0, "remote_pp_rank": 0, "heads": [0, 4], "local_heads": [0, 4],
             "remote_heads": [0, 4], "layers": [0, 16]},
            {"remote_tp_rank": 1, "remote_pp_rank": 0, "heads": [4, 8], "local_heads": [4, 8],
             "remote_heads": [0, 4], "layers": [0, 16]},
        ],
    }]
    assert out["consumers"] == {"0/0": 1, "1/0": 1}


def test_mla_json_heads_are_zero_one_and_partitions_parse():
    result = invoke("--kv-heads", "1", "--layers", "10", "--prefill-tp", "2", "--decode-tp", "2",
                    "--prefill-pp", "2", "--prefill-layers", "4,6", "--mla", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    reads = out["decode_ranks"][0]["reads"]
    assert [r["heads"] for r in reads] == [[0, 1], [0, 1]]
    assert [r["layers"] for r in reads] == [[0, 4], [4, 10]]
    assert list(out["consumers"]) == ["0/0", "1/0", "0/1", "1/1"]


def test_table_is_the_default():
    result = invoke("--kv-heads", "24", "--layers", "32", "--prefill-tp", "6", "--decode-tp", "4")
    assert result.exit_code == 0, result.output
    assert "decode tp/pp" in result.stdout and "1/0=2" in result.stdout


def test_bad_configs_exit_2_with_one_line():
    for opts in (
        ("--kv-heads", "8", "--layers", "32", "--prefill-tp", "3", "--decode-tp", "2"),
        ("--kv-heads", "8", "--layers", "32", "--prefill-tp", "2", "--decode-tp", "2",
         "--decode-pp", "2", "--decode-layers", "10,x"),
        ("--kv-heads", "8", "--layers", "2", "--prefill-tp", "2", "--decode-tp", "2",
         "--decode-pp", "3"),
    ):
        result = invoke(*opts)
        assert result.exit_code == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvd: error: "), result.stderr
        assert "Traceback" not in result.output


def test_plan_path_does_not_import_heavy_modules():
    import subprocess
    import sys

    code = ("import sys, kvd.cli, kvd.tools.plan.render; "
            "print(sorted(m for m in ('torch', 'nixl', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

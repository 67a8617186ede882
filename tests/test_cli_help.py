"""`kvd --help` lists every command with a whole first sentence: typer shows a
docstring's first paragraph there, keeping its line breaks, so a first paragraph that
runs over several lines reads as a description cut mid-sentence."""

from __future__ import annotations

import re

from typer.main import get_command
from typer.testing import CliRunner

from kvd.cli import app


def test_every_command_summary_is_one_short_sentence():
    group = get_command(app)
    bad = []
    for name, cmd in group.commands.items():
        first = (cmd.help or "").strip().split("\n\n")[0]
        if "\n" in first or not first.endswith((".", ")")) or len(first) > 90:
            bad.append(f"{name}: {first!r}")
    assert not bad, "first docstring paragraphs that --help would cut:\n" + "\n".join(bad)


def test_help_shows_each_summary_whole():
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert out.exit_code == 0
    text = re.sub(r"[│\s]+", " ", out.output)
    for name, cmd in get_command(app).commands.items():
        first = " ".join((cmd.help or "").strip().split("\n\n")[0].split())
        assert first in text, (name, first)


def _help(*args: str) -> str:
    out = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "100"}, terminal_width=100)
    assert out.exit_code == 0, out.output
    return out.output


def test_version() -> None:
    import kvd

    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output == f"kvd {kvd.__version__}\n"


def test_flags_show_no_value_and_options_their_type() -> None:
    """typer shows a type for every option; a flag takes no value, so none is shown."""
    for args, flag in ((("status",), "--json"), (("bench",), "--workers-curve"), ((), "--help"),
                       (("serve",), "--insecure")):
        line = next(ln for ln in _help(*args).splitlines() if f" {flag} " in ln)
        assert "<bool>" not in line, line
    assert "<float>" in next(ln for ln in _help("status").splitlines() if "--timeout-s" in ln)


def test_help_keeps_brackets_and_does_not_break_a_sentence_midway() -> None:
    """Markdown help: a bracket is text ('kvd[plot]', the [kvd] table), an underscore is
    not emphasis, and a docstring's paragraph flows as one (its line breaks are not kept,
    to be wrapped again mid-phrase)."""
    assert "kvd[plot]" in re.sub(r"[│\s]+", "", _help("bench"))
    serve = re.sub(r"[│\s]+", " ", _help("serve"))
    assert "([kvd] table)" in serve and "_KEEPINTVL, _KEEPCNT; an explicit UCX_* variable" in serve
    bench = _help("bench")
    curve = next(ln for ln in bench.splitlines() if "│ curve " in ln)
    assert "alternating: large pull throughput" in re.sub(r"[│\s]+", " ", bench)
    assert not curve.rstrip(" │").endswith("large"), curve

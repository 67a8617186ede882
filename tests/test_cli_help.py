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

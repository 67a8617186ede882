"""`kvd serve` takes every Config field as a flag, generated from the schema."""

from __future__ import annotations

from dataclasses import fields

import pytest
from typer.testing import CliRunner

from kvd.cli import app
from kvd.config import Config

RUNNER = CliRunner()


def test_help_lists_every_config_field_as_a_flag() -> None:
    out = RUNNER.invoke(app, ["serve", "--help"], terminal_width=250, env={"COLUMNS": "250"})
    assert out.exit_code == 0, out.output
    missing = [f.name for f in fields(Config) if f"--{f.name.replace('_', '-')}" not in out.output]
    assert not missing, f"kvd serve --help lacks {missing}"
    assert "[kvd] table" in out.output  # rich markup must not eat the brackets


def test_generated_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Config] = []

    def fake_run(cfg: Config) -> int:
        seen.append(cfg)
        return 0

    monkeypatch.setattr("kvd.daemon.run.run", fake_run)
    out = RUNNER.invoke(app, ["serve", "--max-engines", "9", "--lease-s", "12.5", "--insecure",
                              "--max-pool-bytes", "4096", "--set", "engine_timeout_s=7"],
                        env={})
    assert out.exit_code == 0, out.output
    [cfg] = seen
    assert (cfg.max_engines, cfg.lease_s, cfg.insecure, cfg.max_pool_bytes,
            cfg.engine_timeout_s) == (9, 12.5, True, 4096, 7.0)


def test_a_bad_flag_value_names_the_field_and_exits_2() -> None:
    out = RUNNER.invoke(app, ["serve", "--max-engines", "0"], env={})
    assert out.exit_code == 2
    assert "max_engines" in out.output and "must be > 0" in out.output

"""Generated references and dashboard copies match what scripts/gen_docs.py produces now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts/gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_docs", module)
    spec.loader.exec_module(module)
    return module


GEN = _gen_docs()


@pytest.mark.parametrize("rel", sorted(GEN.TARGETS))
def test_generated_file_is_up_to_date(rel: str) -> None:
    path = ROOT / rel
    assert path.is_file(), f"{rel} missing: run python scripts/gen_docs.py"
    assert path.read_text() == GEN.TARGETS[rel](), f"{rel} is stale: run python scripts/gen_docs.py"


def test_configuration_reference_names_every_field_and_env_var() -> None:
    from dataclasses import fields

    from kvd.config import Config, knobs

    text = (ROOT / "docs/configuration.md").read_text()
    for f in fields(Config):
        assert f"`{f.name}`" in text and f"`KVD_{f.name.upper()}`" in text
        assert knobs()[f.name].help in text, f"{f.name}: its help is not in the reference"


def test_configuration_example_file_loads(tmp_path: Path) -> None:
    from kvd.config import Config, load

    text = (ROOT / "docs/configuration.md").read_text()
    toml = text.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "kvd.toml"
    path.write_text(toml)
    assert load(path, env={}) == Config()


def test_metrics_reference_lists_every_metric() -> None:
    from kvd.ops.metric_docs import METRIC_DOCS

    text = (ROOT / "docs/metrics.md").read_text()
    for doc in METRIC_DOCS:
        assert f"| `{doc.name}` | {doc.type} |" in text


def test_check_mode_reports_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GEN, "ROOT", tmp_path)
    assert GEN.main(["--check"]) == 1
    assert GEN.main([]) == 0
    assert GEN.main(["--check"]) == 0
    assert (tmp_path / "docs/metrics.md").read_text() == GEN.metrics_md()

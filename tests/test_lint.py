"""ruff over the whole tree, with the project's rules (pyproject.toml), in every suite.

Those rules include the security ones that replace a hand-written scan: no pickle,
dill, shelve or marshal (imported: TID251; loaded: S301, S302), no eval or exec
(S307, S102), no unsafe yaml.load (S506): kvd's wire is msgpack via msgspec only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["kvd", "tests", "scripts", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return subprocess.run([exe, "check", "--no-cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_ruff_passes_on_the_whole_tree():
    out = _ruff(*TREES)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_targets_the_python_the_package_requires():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = cfg["project"]["requires-python"].removeprefix(">=").strip()
    assert cfg["tool"]["ruff"]["target-version"] == "py" + floor.replace(".", "")


@pytest.mark.parametrize(("source", "rule"), [
    ("import pickle\n", "TID251"),
    ("from dill import loads\n", "TID251"),
    ("import marshal\n", "TID251"),
    ("import yaml\nyaml.load(open('x'))\n", "S506"),
    ("print(eval('1 + 1'))\n", "S307"),
    ("exec('x = 1')\n", "S102"),
])
def test_the_security_rules_catch_what_they_claim_to(tmp_path, source, rule):
    """The rules replace the former no-pickle test module: each forbidden use is caught."""
    bad = tmp_path / "kvd_bad.py"
    bad.write_text(source)
    out = _ruff("--config", str(ROOT / "pyproject.toml"), "--output-format", "concise",
                str(bad))
    assert out.returncode == 1 and rule in out.stdout, out.stdout + out.stderr

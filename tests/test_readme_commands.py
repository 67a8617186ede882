"""README's commands: the marked ones are there for whoever extracts them, and none is
a line too long to read.

.ci/run runs the command under ``<!-- test-command -->`` on a fresh clone (its awk is
run here as written); ``demo-command`` and ``vllm-test-command`` mark the others a
reader copies. A set-up longer than a line is a script in scripts/ (CONTRIBUTING, Docs).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MARKERS = ("demo-command", "test-command", "vllm-test-command")
LONGEST_LINE_CHARS = 250  # the vLLM 0.33 set-up was one line of 833 before scripts/


def _ci_awk() -> str:
    """The awk program .ci/run extracts the test command with."""
    return re.search(r"awk '([^']*)' README\.md", (ROOT / ".ci/run").read_text()).group(1)


def test_every_marker_heads_one_shell_block() -> None:
    for marker in MARKERS:
        assert re.search(rf"<!-- {marker} -->\n```sh\n[^\n]+\n```", README), marker


def test_ci_extracts_the_test_command() -> None:
    out = subprocess.run(["awk", _ci_awk(), str(ROOT / "README.md")], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out.startswith("python3 -m venv .venv") and out.endswith("python -m pytest -q")


def test_no_command_line_is_too_long_to_read() -> None:
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    long = [line[:60] + "..." for block in blocks for line in block.splitlines()
            if len(line) > LONGEST_LINE_CHARS]
    assert not long, f"README command lines over {LONGEST_LINE_CHARS} characters: {long}"


def test_the_scripts_it_runs_exist_and_parse() -> None:
    scripts = set(re.findall(r"bash (scripts/[\w.-]+\.sh)", README))
    assert "scripts/venv-vllm033.sh" in scripts, scripts
    for script in scripts:
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)

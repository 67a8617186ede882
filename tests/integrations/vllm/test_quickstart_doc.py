"""docs/vllm.md's quickstart blocks are found and become one script with every documented
port remapped (the vLLM suite runs it: tests/vllm/test_quickstart.py; this guards its
structure in the default suite, which has no vLLM)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart_doc",
                                                  ROOT / "tests/vllm/quickstart.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_step_is_a_block_and_every_port_is_remapped(tmp_path: Path) -> None:
    qs = _quickstart()
    assert list(qs.blocks()) == list(qs.STEPS)
    ports = {p: 40000 + i for i, p in enumerate(qs.PORTS)}
    text = qs.script(ports, tmp_path, Path("/venv/bin"))
    left = [p for p in qs.PORTS if re.search(rf"\b{p}\b", text)]
    assert not left, f"documented ports not remapped: {left}"
    assert f"export QS={tmp_path}" in text and "source .venv-vllm" not in text
    for step in ("kvd serve", "vllm.entrypoints.openai.api_server", "kvd router",
                 "/v1/completions", "prompt_tokens_by_source_total"):
        assert step in text

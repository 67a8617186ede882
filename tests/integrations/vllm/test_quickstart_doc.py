"""docs/vllm.md's quickstart blocks are found and become one script with every documented
port remapped (the vLLM suite runs it: tests/integrations/vllm/test_quickstart.py; this guards its
structure in the default suite, which has no vLLM)."""

from __future__ import annotations

import re
from pathlib import Path

import quickstart


def test_every_step_is_a_block_and_every_port_is_remapped(tmp_path: Path) -> None:
    assert list(quickstart.blocks()) == list(quickstart.STEPS)
    ports = {p: 40000 + i for i, p in enumerate(quickstart.PORTS)}
    text = quickstart.script(ports, tmp_path, Path("/venv/bin"))
    left = [p for p in quickstart.PORTS if re.search(rf"\b{p}\b", text)]
    assert not left, f"documented ports not remapped: {left}"
    assert f"export QS={tmp_path}" in text and "source .venv-vllm" not in text
    for step in ("kvd serve", "vllm.entrypoints.openai.api_server", "kvd router",
                 "/v1/completions", "prompt_tokens_by_source_total"):
        assert step in text

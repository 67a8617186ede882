"""The quickstart of docs/vllm.md as one runnable script (standard library only).

Each step of the quickstart is a ``sh`` block preceded by ``<!-- quickstart:NAME -->``;
``script()`` joins them in order, as written, changing only what a shared test machine
needs changed: the ports (other runs may hold the documented ones), the work directory,
and ``source .venv-vllm/bin/activate`` (the test runs in whichever venv has vLLM).
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"
STEPS = ("setup", "daemons", "servers", "router", "request", "metrics", "stop")
# Printed before the stop step, which then waits for the file $QS/stop to exist.
DONE = "=== quickstart:done"
STOP_FILE = "stop"
# Every port the quickstart uses: the daemon (engine, peer, metrics), two servers, router.
PORTS = (7100, 7101, 7102, 8100, 8200, 8000)
_BLOCK = re.compile(r"<!-- quickstart:(\w+) -->\n```sh\n(.*?)```", re.S)


def blocks(text: str | None = None) -> dict[str, str]:
    """The quickstart's shell blocks by name, in the document's order."""
    found = dict(_BLOCK.findall(DOC.read_text() if text is None else text))
    missing = [s for s in STEPS if s not in found]
    if missing:
        raise ValueError(f"docs/vllm.md lacks quickstart blocks {missing}")
    return found


def script(ports: dict[int, int], work_dir: Path, venv_bin: Path,
           text: str | None = None) -> str:
    """The quickstart as one bash script, with ``ports`` remapped and ``work_dir`` as $QS.
    It prints DONE before the stop step, then waits for ``$QS/stop`` to run that step."""
    parts = []
    for name, body in blocks(text).items():
        body = body.replace("source .venv-vllm/bin/activate",
                            f'export PATH="{venv_bin}:$PATH"')
        body = re.sub(r"export QS=\S+", f"export QS={work_dir}", body)
        body = re.sub(r"\b(" + "|".join(map(str, PORTS)) + r")\b",
                      lambda m: str(ports[int(m.group(1))]), body)
        if name == "stop":  # the caller says when, by creating $QS/stop
            parts.append(f"echo '{DONE}'\n"
                         f'while [ ! -e "$QS/{STOP_FILE}" ]; do sleep 1; done')
        parts.append(f"echo '=== quickstart:{name}'\n{body}")
    return "\n".join(parts)

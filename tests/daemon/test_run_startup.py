"""What ``kvd serve`` loads before it answers ``/livez``: only the daemon itself.

A restarted daemon should answer its probes within a second of exec on a quiet host
(measured: about 0.3 s of its own CPU; docs/notes/2026-11-28-house.md). Wall time on a
shared host says little, so this counts what decides it: the modules imported by the
moment the HTTP server starts (the faces are bound just before). The NIXL agent, the
copiers, torch and every tool are loaded after it, or only when used.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

# Imported only after /livez answers, or only where used.
NOT_BEFORE_LIVEZ = (
    "torch", "nixl", "nixl_cu12", "nixl_cu13", "vllm", "aiohttp", "matplotlib",
    "kvd.integrations", "kvd.transport.copies", "kvd.transport.remote.nixl",
    "kvd.tools.bench.run", "kvd.tools.router", "kvd.tools.demo", "kvd.tools.tiny_model",
    "kvd.tools.plan", "kvd.tools.sim", "kvd.tools.localcluster",
)

PROBE = r"""
import json, os, sys
import kvd.ops.httpserver as http

def started(*args, **kwargs):
    print(json.dumps(sorted(sys.modules)))
    sys.stdout.flush()
    os._exit(0)

http.start_http_server = started
from kvd.cli import app
app(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def modules_before_livez(tmp_path) -> list[str]:
    args = ["serve", "--engine-address", f"tcp://127.0.0.1:{_free_port()}",
            "--peer-address", f"tcp://127.0.0.1:{_free_port()}",
            "--metrics-port", str(_free_port()), "--set", f"shm_dir={tmp_path}",
            "--set", "shm_prefix=kvd-startup"]
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serve_loads_no_agent_copier_torch_or_tool_before_livez(tmp_path) -> None:
    loaded = modules_before_livez(tmp_path)
    assert "kvd.daemon.server" in loaded  # the probe stopped where it should
    early = sorted(m for m in loaded for p in NOT_BEFORE_LIVEZ
                   if m == p or m.startswith(p + "."))
    assert not early, f"imported before /livez answers: {early}"

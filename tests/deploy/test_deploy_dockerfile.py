"""deploy/Dockerfile, checked statically (docker cannot run here), and its
HEALTHCHECK command run for real against kvd's HTTP server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from support.kvd_pod_checks import DEPLOY, ROOT, port_of

from kvd.config import Config
from kvd.ops.httpserver import start_http_server
from kvd.ops.metrics import Metrics

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def of(kind: str) -> list[str]:
    return [rest for word, rest in instructions() if word == kind]


def test_base_is_a_build_argument_with_cpu_default() -> None:
    assert "BASE=python:3.11-slim" in of("ARG")
    froms = of("FROM")
    assert froms and all(f.startswith("${BASE}") for f in froms)
    runs = " ".join(of("RUN"))
    assert "-c constraints-cpu.txt" in runs and "cpu)" in runs and "cuda)" in runs
    assert "nvidia/cuda" in DOCKERFILE.read_text()  # the CUDA build is documented


def test_non_root_entrypoint_and_ports() -> None:
    (user,) = of("USER")
    assert user.split(":")[0] not in ("0", "root")
    assert json.loads(of("ENTRYPOINT")[-1]) == ["kvd", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "kvd" in scripts
    exposed = {int(p) for p in " ".join(of("EXPOSE")).split()}
    cfg = Config()
    assert exposed == {port_of(cfg.engine_address), port_of(cfg.peer_address), cfg.metrics_port}


def test_copied_sources_exist() -> None:
    for rest in of("COPY"):
        if rest.startswith("--from"):
            continue
        for src in rest.split()[:-1]:
            if src == "README.md":  # required by pyproject; written with the daemon
                assert "README.md" in (ROOT / "pyproject.toml").read_text()
                continue
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def healthcheck_cmd() -> list[str]:
    (hc,) = of("HEALTHCHECK")
    cmd = json.loads(hc.split("CMD", 1)[1].strip())
    assert "curl" not in hc and "wget" not in hc
    assert "/livez" in hc and "7102" in hc
    return cmd


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_healthcheck_passes_against_a_serving_kvd(host: str) -> None:
    cmd = healthcheck_cmd()
    assert cmd[0] == "python3"
    server = start_http_server("127.0.0.1", 0, Metrics().registry, lambda: (False, "starting"))
    try:
        env = {**os.environ, "KVD_METRICS_PORT": str(server.port), "KVD_METRICS_HOST": host}
        proc = subprocess.run([sys.executable, *cmd[1:]], env=env, timeout=10)
        assert proc.returncode == 0  # live even while not ready
    finally:
        server.close()
    env = {**os.environ, "KVD_METRICS_PORT": str(server.port)}
    assert (
        subprocess.run(
            [sys.executable, *cmd[1:]], env=env, timeout=10, capture_output=True
        ).returncode
        != 0
    )

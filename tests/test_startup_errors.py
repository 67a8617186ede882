"""Every startup failure of `kvd serve` and `kvd status` is one `kvd: error:` line naming
the setting and its value, and a failed start leaves nothing in the pool directory.

The daemon-level cases run a Daemon in this process (loopback transport) with a tmp
``shm_dir``; the command-line cases run ``python -m kvd`` as a user would, and check
that stderr is exactly one line (no traceback) unless ``--debug``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from kvd.config import Config, client_engine_address
from kvd.daemon.server import Daemon
from kvd.errors import ConfigError
from kvd.tools.localcluster import free_port
from kvd.transport.loopback import LoopbackTransport

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def taken_tcp_port() -> Iterator[int]:
    """A port bound and listening by this process for the duration."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _cfg(tmp_path: Path, **overrides: object) -> Config:
    settings: dict[str, object] = {
        "engine_address": f"tcp://127.0.0.1:{free_port()}",
        "peer_address": f"tcp://127.0.0.1:{free_port()}", "metrics_port": 0,
        "shm_dir": str(tmp_path), "shm_prefix": "kvd-startup", **overrides}
    return Config(**settings)  # type: ignore[arg-type]


def _start_fails(cfg: Config) -> str:
    async def go() -> str:
        daemon = Daemon(cfg, transport_factory=LoopbackTransport)
        with pytest.raises(ConfigError) as info:
            await daemon.start()
        return str(info.value)

    return asyncio.run(go())


@pytest.mark.parametrize("setting", ["engine_address", "peer_address", "metrics_port"])
def test_port_in_use_names_the_setting_and_leaves_no_lock(tmp_path: Path, setting: str) -> None:
    with taken_tcp_port() as port:
        value: object = port if setting == "metrics_port" else f"tcp://127.0.0.1:{port}"
        message = _start_fails(_cfg(tmp_path, **{setting: value}))
    assert message.startswith(f"{setting}=") and str(port) in message, message
    assert "in use" in message.lower(), message
    assert os.listdir(tmp_path) == [], "a failed start left files in shm_dir"


def test_missing_ipc_directory_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "kvd"
    shm = tmp_path / "shm"
    shm.mkdir()
    message = _start_fails(_cfg(shm, engine_address=f"ipc://{missing}/engine.sock"))
    assert message == (f"engine_address='ipc://{missing}/engine.sock': directory "
                       f"'{missing}' does not exist"), message
    assert os.listdir(shm) == []


def test_failed_start_closes_its_sockets(tmp_path: Path) -> None:
    """The faces bound before the failure are closed: their ports can be bound again."""
    cfg = _cfg(tmp_path)
    with taken_tcp_port() as port:
        _start_fails(Config(**{**cfg.__dict__, "metrics_port": port}))
    ctx = zmq.Context()
    try:
        for address in (cfg.engine_address, cfg.peer_address):
            sock = ctx.socket(zmq.ROUTER)
            sock.bind(address)
            sock.close(0)
    finally:
        ctx.term()


@pytest.mark.parametrize(("given", "env", "expected"), [
    ("127.0.0.1:17100", {}, "tcp://127.0.0.1:17100"),
    ("ipc:///tmp/kvd.sock", {}, "ipc:///tmp/kvd.sock"),
    (None, {"KVD_ENGINE_ADDRESS": "10.0.0.2:7100"}, "tcp://10.0.0.2:7100"),
    (None, {}, "tcp://127.0.0.1:7100"),
])
def test_client_address_host_port_means_tcp(given: str | None, env: dict[str, str],
                                            expected: str) -> None:
    assert client_engine_address(given, env) == expected


@pytest.mark.parametrize(("given", "env", "named"), [
    (None, {"KVD_ENGINE_ADDRESS": ""}, "KVD_ENGINE_ADDRESS is empty"),
    ("http://x:1", {}, "--address: 'http://x:1'"),
    ("127.0.0.1", {}, "--address: 'tcp://127.0.0.1'"),
])
def test_client_address_refusals_name_the_source(given: str | None, env: dict[str, str],
                                                 named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        client_engine_address(given, env)


def _kvd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True,
                          timeout=60, env=full_env, cwd=REPO)


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvd: error: "), lines
    return lines[0]


def test_cli_serve_port_in_use_is_one_line(tmp_path: Path) -> None:
    with taken_tcp_port() as port:
        line = _one_error_line(_kvd(
            "serve", "--metrics-port", str(port), "--shm-dir", str(tmp_path),
            "--engine-address", f"tcp://127.0.0.1:{free_port()}",
            "--peer-address", f"tcp://127.0.0.1:{free_port()}"))
        assert f"metrics_port={port}" in line
        debug = _kvd("serve", "--debug", "--metrics-port", str(port), "--shm-dir",
                     str(tmp_path), "--engine-address", f"tcp://127.0.0.1:{free_port()}",
                     "--peer-address", f"tcp://127.0.0.1:{free_port()}")
    assert "Traceback" in debug.stderr
    assert os.listdir(tmp_path) == []


def test_cli_serve_missing_ipc_directory_is_one_line(tmp_path: Path) -> None:
    line = _one_error_line(_kvd(
        "serve", "--metrics-port", "0", "--shm-dir", str(tmp_path),
        "--engine-address", f"ipc://{tmp_path}/nope/engine.sock",
        "--peer-address", f"tcp://127.0.0.1:{free_port()}"))
    assert f"engine_address='ipc://{tmp_path}/nope/engine.sock'" in line
    assert "does not exist" in line


def test_cli_status_host_port_is_tcp_and_one_line() -> None:
    port = free_port()  # nobody listens: the answer is a timeout naming the tcp address
    line = _one_error_line(_kvd("status", "--address", f"127.0.0.1:{port}",
                                "--timeout-s", "0.3"))
    assert f"tcp://127.0.0.1:{port}" in line


def test_cli_status_empty_env_address_is_one_line() -> None:
    line = _one_error_line(_kvd("status", env={"KVD_ENGINE_ADDRESS": ""}))
    assert "KVD_ENGINE_ADDRESS is empty" in line


@pytest.mark.parametrize(("args", "module", "named"), [
    (["router", "--prefill", "http://a:1", "--decode", "http://b:2"], "aiohttp", "kvd[router]"),
    (["tiny-model", "{tmp}/model"], "safetensors", "kvd[tiny-model]"),
])
def test_missing_optional_dependency_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path, args: list[str], module: str,
                                                 named: str) -> None:
    from typer.testing import CliRunner

    from kvd.cli import app

    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "kvd.tools.router.app", raising=False)
    out = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvd: error: ") and named in lines[0]

"""`kvd status` as an operator runs it: a subprocess against a running daemon."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvd
from kvd.client import KvdClient
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess, free_port
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

KVD = str(Path(sys.executable).with_name("kvd"))  # the console script of this venv
MODEL = ModelSpec(name="status-model", num_kv_heads=4, num_layers=2, head_dim=32)
SHAPE = EngineShape(tp_size=2, block_size_tokens=16, num_blocks=32)
LEASE_S = 120.0


def kvd_status(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVD, "status", *args], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, str]]:
    # pool_backing=shm: pools named after the daemon on every host (memfd pools, which
    # auto takes where 2 MiB pages are reserved, are named by their fd)
    d = DaemonProcess.start(f"status-{uuid.uuid4().hex[:6]}", tmp_path_factory.mktemp("logs"),
                            extra_args=["--set", "pool_backing=shm"])
    client: KvdClient | None = None
    ranks = []
    try:
        client = d.client()
        engine_id = f"status-engine-{uuid.uuid4().hex[:6]}"
        ranks = [client.register(engine_id, MODEL, layout_spec(SHAPE), t, SHAPE.tp_size)
                 for t in range(SHAPE.tp_size)]
        client.publish(engine_id, "status-req", [3, 4, 5], lease_s=LEASE_S)
        yield d, engine_id
    finally:
        if client is not None:
            for r in ranks:  # releases the held request, so the drain on SIGTERM is quick
                client.deregister(r)
            client.close()
        rc = d.stop()
        for name in kvd_segments(f"kvd-{d.name}"):
            (SHM_DIR / name).unlink(missing_ok=True)
        assert rc == 0, d.log_path.read_text()[-3000:]


def test_status_json(daemon: tuple[DaemonProcess, str]) -> None:
    d, engine_id = daemon
    proc = kvd_status("--address", d.engine_address, "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["version"] == kvd.__version__ and st["draining"] is False and st["daemon_id"]
    ranks = sorted((e for e in st["engines"] if e["engine_id"] == engine_id),
                   key=lambda e: e["rank"])
    assert len(ranks) == SHAPE.tp_size
    for e in ranks:
        assert (e["tp_size"], e["pp_size"], e["gone"]) == (SHAPE.tp_size, 1, False)
        assert e["pool_bytes"] > 0 and e["pool"].startswith(f"kvd-{d.name}")
        assert e["pins"] == 1  # the held request pins every rank's pool
    [held] = [h for h in st["held"] if h["request_id"] == "status-req"]
    assert (held["engine_id"], held["state"], held["blocks"]) == (engine_id, "held", 3)
    assert LEASE_S - 30 < held["lease_remaining_s"] <= LEASE_S
    assert st["pulls"] == [] and st["peers"] == []


def test_status_table(daemon: tuple[DaemonProcess, str]) -> None:
    d, engine_id = daemon
    proc = kvd_status("--address", d.engine_address)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"kvd {kvd.__version__}" in out
    assert "engines (2 ranks)" in out and "held requests (1)" in out
    assert sum(engine_id in line for line in out.splitlines()) == 3  # 2 ranks + 1 held
    held_line = next(line for line in out.splitlines() if "status-req" in line)
    assert "blocks=3" in held_line and "lease " in held_line


def test_status_of_nothing_listening_fails_fast_with_one_line() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = kvd_status("--address", address, "--timeout-s", "1", "--json")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvd: error:") and address in lines[0]
    assert "nothing listens there: start the daemon (kvd serve)" in lines[0]  # and how
    assert "--address HOST:PORT or KVD_ENGINE_ADDRESS" in lines[0]
    assert elapsed < 1 + 10, f"took {elapsed:.1f}s with --timeout-s 1"  # 1 s + interpreter start


def test_status_of_a_port_that_is_not_kvd_says_something_listens(tmp_path: Path) -> None:
    from kvd.ops.status import unanswered_hint

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert unanswered_hint(f"tcp://127.0.0.1:{port}").startswith("something listens there")
    assert unanswered_hint(f"ipc://{tmp_path}/none.sock").startswith("nothing listens there")

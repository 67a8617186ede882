"""The metrics/health server answers real HTTP requests on an ephemeral port."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvd.ops.httpserver import HttpServerHandle, start_http_server
from kvd.ops.metrics import Metrics


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


@pytest.fixture
def state() -> dict[str, object]:
    return {"ready": False, "reason": "nixl agent not started"}


@pytest.fixture
def server(state: dict[str, object]) -> Iterator[tuple[HttpServerHandle, Metrics]]:
    metrics = Metrics()
    handle = start_http_server(
        "127.0.0.1", 0, metrics.registry, lambda: (bool(state["ready"]), str(state["reason"]))
    )
    yield handle, metrics
    handle.close()


def test_port_zero_reports_bound_port(server: tuple[HttpServerHandle, Metrics]) -> None:
    handle, _ = server
    assert handle.port > 0
    assert handle.url == f"http://127.0.0.1:{handle.port}"


def test_metrics_exposition(server: tuple[HttpServerHandle, Metrics]) -> None:
    handle, metrics = server
    metrics.transfer_finished("consumer", "ok", 8192, 0.01)
    code, ctype, body = get(handle.url + "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    assert 'kvd_transfers_total{outcome="ok",path="remote",role="consumer"} 1.0' in body
    assert 'kvd_transferred_bytes_total{path="remote",role="consumer"} 8192.0' in body
    assert "# TYPE kvd_transfer_duration_seconds histogram" in body
    # only this daemon's registry: no process/python collectors from the global default
    assert "python_gc_objects_collected_total" not in body


def test_livez_always_ok_and_readyz_follows_callback(
    server: tuple[HttpServerHandle, Metrics], state: dict[str, object]
) -> None:
    handle, _ = server
    assert get(handle.url + "/livez")[0::2] == (200, "ok\n")
    assert get(handle.url + "/readyz")[0::2] == (503, "nixl agent not started\n")
    state.update(ready=True, reason="ready: 2 engines")
    assert get(handle.url + "/readyz")[0::2] == (200, "ready: 2 engines\n")
    state.update(ready=False, reason="draining")
    assert get(handle.url + "/readyz")[0::2] == (503, "draining\n")
    assert get(handle.url + "/livez")[0] == 200


def test_readyz_callback_that_raises_is_not_ready() -> None:
    def boom() -> tuple[bool, str]:
        raise RuntimeError("loop gone")

    handle = start_http_server("127.0.0.1", 0, Metrics().registry, boom)
    try:
        code, _, body = get(handle.url + "/readyz")
        assert code == 503 and "loop gone" in body
        assert get(handle.url + "/livez")[0] == 200
    finally:
        handle.close()


def test_unknown_path_is_404(server: tuple[HttpServerHandle, Metrics]) -> None:
    handle, _ = server
    assert get(handle.url + "/nope")[0] == 404
    assert get(handle.url + "/metrics/extra")[0] == 404


def test_no_access_log_on_stderr(
    server: tuple[HttpServerHandle, Metrics], capfd: pytest.CaptureFixture[str]
) -> None:
    handle, _ = server
    for path in ("/livez", "/readyz", "/metrics", "/missing"):
        get(handle.url + path)
    assert capfd.readouterr().err == ""


def test_close_releases_port_and_is_idempotent() -> None:
    handle = start_http_server("127.0.0.1", 0, Metrics().registry, lambda: (True, "ok"))
    port = handle.port
    handle.close()
    handle.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_port_conflict_raises_at_start() -> None:
    handle = start_http_server("127.0.0.1", 0, Metrics().registry, lambda: (True, "ok"))
    try:
        with pytest.raises(OSError):
            start_http_server("127.0.0.1", handle.port, Metrics().registry, lambda: (True, "ok"))
    finally:
        handle.close()

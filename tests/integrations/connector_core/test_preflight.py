"""The server's first look at its kvd (kvd.integrations.connector_core.preflight): the
config is found on the importing stack, a dial that nothing answers becomes kvd's one
line at once, and everything else (a listening daemon, no KvdConnector config, a config
the connector refuses itself) passes untouched. Real sockets; no vLLM."""

from __future__ import annotations

import multiprocessing
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvd.integrations.connector_core import preflight


def _config(address: str, connector: str = "KvdConnector", engine_id: str = "prefill-0",
            **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(kv_connector=connector, engine_id=engine_id,
                           kv_connector_extra_config={"kvd_address": address, **extra})


def _closed_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_tcp_dial_is_kvd_line_at_once() -> None:
    address = f"tcp://127.0.0.1:{_closed_tcp_port()}"
    start = time.monotonic()
    line = preflight.check(_config(address, kvd_request_timeout_s=30))
    assert time.monotonic() - start < 1.0  # not the 30 s request timeout
    assert line == preflight.unreachable_line(address,
                                              "connection refused: nothing listens there")
    assert "\n" not in line and "start `kvd serve`" in line and "kvd_address" in line


def test_a_listening_daemon_passes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        assert preflight.check(_config(address)) is None
        assert preflight.check(_config(address.removeprefix("tcp://"))) is None  # host:port


def test_ipc_without_its_socket_file(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    assert preflight.why_unreachable(address, 1.0) == f"no socket file at {tmp_path}/engine.sock"


def test_ipc_stale_socket_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: a daemon that died leaves this
    assert preflight.why_unreachable(f"ipc://{path}", 1.0) == (
        "connection refused: nothing listens there")


def test_ipc_listening_passes(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen(1)
        assert preflight.why_unreachable(f"ipc://{path}", 1.0) is None


def test_a_dial_with_no_answer_waits_the_request_timeout() -> None:
    def silent(sock: socket.socket, target: Any) -> None:
        assert sock.gettimeout() == 2.5
        raise TimeoutError

    line = preflight.check(_config("tcp://10.0.0.1:7100", kvd_request_timeout_s=2.5),
                           connect=silent)
    assert line is not None and "(no answer to a connect within 2.5s)" in line


def test_an_unresolvable_host_says_so() -> None:
    why = preflight.why_unreachable("tcp://no-such-host.invalid:7100", 1.0)
    assert why is not None and why.startswith("cannot resolve 'no-such-host.invalid'")


def test_a_config_the_connector_refuses_is_left_to_it() -> None:
    address = f"tcp://127.0.0.1:{_closed_tcp_port()}"
    assert preflight.check(_config(address, engine_id="")) is None  # no engine_id


def test_config_found_in_the_importing_frames() -> None:
    def get_connector_class(kv_transfer_config: Any) -> Any:  # as vLLM's factory holds it
        return importing()

    def importing() -> Any:
        return preflight.config_on_stack(sys._getframe())

    ours = _config("tcp://127.0.0.1:7100")
    assert get_connector_class(ours) is ours
    assert get_connector_class(_config("x", connector="NixlConnector")) is None
    assert importing() is None


def test_check_at_import_exits_with_the_line() -> None:
    address = f"tcp://127.0.0.1:{_closed_tcp_port()}"
    kv_transfer_config = _config(address)  # noqa: F841 (found on the stack)
    with pytest.raises(SystemExit) as info:
        preflight.check_at_import(sys._getframe())
    assert info.value.code == preflight.unreachable_line(
        address, "connection refused: nothing listens there")


def test_check_at_import_is_inert_without_a_kvd_config() -> None:
    kv_transfer_config = _config(f"tcp://127.0.0.1:{_closed_tcp_port()}",  # noqa: F841
                                 connector="LMCacheConnectorV1")
    preflight.check_at_import(sys._getframe())  # returns; nothing raised


def _import_in_child(address: str) -> str:
    kv_transfer_config = _config(address)  # noqa: F841 (found on the stack)
    preflight.check_at_import(sys._getframe())
    return "passed"


def test_check_at_import_is_inert_in_a_child_process() -> None:
    """vLLM's engine core and workers import the package too; only the process that
    builds the config checks (before any engine process exists)."""
    address = f"tcp://127.0.0.1:{_closed_tcp_port()}"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_import_in_child, (address,)) == "passed"


@pytest.mark.parametrize(("spec", "argv0", "hard"), [
    ("vllm.entrypoints.openai.api_server", "/x/api_server.py", True),  # python -m ...
    (None, "/venv/bin/vllm", True),  # the console script
    (None, "serve.py", False),  # a user's script that builds LLM(...)
    ("myapp.main", "/x/main.py", False),
])
def test_only_vllms_own_command_exits_hard(spec: str | None, argv0: str, hard: bool) -> None:
    assert preflight.vllm_is_main(spec, argv0) is hard

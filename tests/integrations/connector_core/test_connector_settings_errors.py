"""The connector's startup refusals about kvd_address and the token file are one line
naming the key and the value (vLLM prints it as the worker's last line), and
``host:port`` means tcp as for `kvd status`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvd.integrations.connector_core.settings import (
    ConnectorConfigError,
    ConnectorSettings,
)


def _settings(**extra: object) -> ConnectorSettings:
    return ConnectorSettings.from_vllm(SimpleNamespace(engine_id="prefill-0",
                                                       kv_connector_extra_config=extra))


def test_host_port_means_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVD_ENGINE_ADDRESS", raising=False)
    assert _settings(kvd_address="127.0.0.1:7200").address == "tcp://127.0.0.1:7200"
    assert _settings().address == "tcp://127.0.0.1:7100"


@pytest.mark.parametrize(("extra", "env", "named"), [
    ({"kvd_address": "http://127.0.0.1:7100"}, {}, "kvd_address: 'http://127.0.0.1:7100'"),
    ({}, {"KVD_ENGINE_ADDRESS": ""}, "KVD_ENGINE_ADDRESS is empty"),
    ({"kvd_token_file": "/nonexistent/kvd-token"}, {},
     "kvd_token_file / KVD_AUTH_TOKEN_FILE '/nonexistent/kvd-token'"),
])
def test_refusals_name_the_key(monkeypatch: pytest.MonkeyPatch, extra: dict[str, str],
                               env: dict[str, str], named: str) -> None:
    monkeypatch.delenv("KVD_ENGINE_ADDRESS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConnectorConfigError) as info:
        _settings(**extra)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_token_file_is_read(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123\n")
    assert _settings(kvd_token_file=str(token)).token == "0123456789abcdef0123"


def test_idle_wait_is_a_setting_bounded_to_50_ms() -> None:
    assert _settings().idle_wait_s == 0.005
    assert _settings(kvd_idle_wait_s=0).idle_wait_s == 0.0  # spin, as vLLM does
    assert _settings(kvd_idle_wait_s=5).idle_wait_s == 0.05


def test_producers_are_engine_and_daemon_address_pairs() -> None:
    assert _settings().producers == ()
    got = _settings(kvd_producers=[{"engine_id": "prefill-0", "address": "tcp://10.0.0.5:7300"},
                                   {"engine_id": "prefill-1", "address": "tcp://h:7300"}])
    assert got.producers == (("prefill-0", "tcp://10.0.0.5:7300"), ("prefill-1", "tcp://h:7300"))


@pytest.mark.parametrize("bad", ["prefill-0@tcp://h:1", [{"engine_id": "prefill-0"}],
                                 [{"engine_id": "", "address": "tcp://h:1"}],
                                 [["prefill-0", "tcp://h:1"]]])
def test_a_malformed_producer_list_is_one_line_naming_the_key(bad: object) -> None:
    with pytest.raises(ConnectorConfigError) as info:
        _settings(kvd_producers=bad)
    assert "kvd_producers" in str(info.value) and "\n" not in str(info.value)

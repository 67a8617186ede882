"""Configuration: flag > env > file > default, and a bad value names its field and source."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.config import Config, load
from kvd.errors import ConfigError


def toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvd.toml"
    p.write_text(text)
    return p


def test_defaults_work_out_of_the_box() -> None:
    cfg = load(env={})
    assert cfg == Config()
    assert cfg.peer_advertise == cfg.peer_address


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    f = toml(tmp_path, "[kvd]\nlease_s = 11.0\nhandshake_timeout_s = 7\nmax_engines = 9\n")
    env = {"KVD_LEASE_S": "12", "KVD_HANDSHAKE_TIMEOUT_S": "8"}
    cfg = load(f, env=env, overrides={"lease_s": "13", "engine_timeout_s": None})
    assert cfg.lease_s == 13.0  # flag
    assert cfg.handshake_timeout_s == 8.0  # env beats file
    assert cfg.max_engines == 9  # file beats default
    assert cfg.engine_timeout_s == Config().engine_timeout_s  # None = flag not given


def test_file_without_table_and_bools(tmp_path: Path) -> None:
    f = toml(tmp_path, "nixl_progress_thread = true\n")
    assert load(f, env={}).nixl_progress_thread is True
    assert load(f, env={"KVD_NIXL_PROGRESS_THREAD": "off"}).nixl_progress_thread is False


@pytest.mark.parametrize("env,field", [
    ({"KVD_LEASE_S": "soon"}, "lease_s"),
    ({"KVD_MAX_ENGINES": "1.5"}, "max_engines"),
    ({"KVD_INSECURE": "maybe"}, "insecure"),
    ({"KVD_LEASE_S": "-1"}, "lease_s"),
    ({"KVD_MAX_INFLIGHT_PULLS": "0"}, "max_inflight_pulls"),
    ({"KVD_LOG_LEVEL": "loud"}, "log_level"),
    ({"KVD_DEVICE": "tpu"}, "device"),
    ({"KVD_METRICS_PORT": "70000"}, "metrics_port"),
    ({"KVD_ENGINE_ADDRESS": "127.0.0.1:7100"}, "engine_address"),
    ({"KVD_PEER_ADDRESS": "ipc:///tmp/x"}, "peer_address"),
    ({"KVD_PEER_ADDRESS": "tcp://*:7101"}, "peer_address"),
    ({"KVD_ADVERTISE_ADDRESS": "tcp://host"}, "advertise_address"),
    ({"KVD_AUTH_TOKEN_FILE": "/nonexistent/token"}, "auth_token_file"),
    ({"KVD_HEARTBEAT_INTERVAL_S": "40"}, "heartbeat_interval_s"),
])
def test_bad_env_values_name_the_field(env, field) -> None:
    with pytest.raises(ConfigError, match=field):
        load(env=env)


def test_a_lease_not_longer_than_a_heartbeat_and_the_liveness_timeout_is_refused() -> None:
    """A consumer stalled just under peer_liveness_timeout_s is not noticed as stalled,
    and renews a heartbeat later: a lease that short can lapse under its pull (the fleet
    simulation's seed 2493 reads reused blocks then)."""
    short = {"KVD_LEASE_S": "5", "KVD_HEARTBEAT_INTERVAL_S": "2",
             "KVD_PEER_LIVENESS_TIMEOUT_S": "3"}
    with pytest.raises(ConfigError, match=r"lease_s \(5.0\) must be longer than "
                       r"heartbeat_interval_s \(2.0\) \+ peer_liveness_timeout_s \(3.0\)"):
        load(env=short)
    assert load(env={**short, "KVD_LEASE_S": "5.01"}).lease_s == 5.01


def test_bad_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="lease_s.*flag --lease-s"):
        load(env={}, overrides={"lease_s": "x"})
    with pytest.raises(ConfigError, match="unknown option 'nope'"):
        load(env={}, overrides={"nope": "1"})


def test_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'lease'"):
        load(toml(tmp_path, "[kvd]\nlease = 3\n"), env={})
    with pytest.raises(ConfigError, match="max_engines.*file"):
        load(toml(tmp_path, '[kvd]\nmax_engines = "many"\n'), env={})
    with pytest.raises(ConfigError, match="max_engines"):
        load(toml(tmp_path, "[kvd]\nmax_engines = true\n"), env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="kvd.toml"):
        load(toml(tmp_path, "[kvd\n"), env={})


def test_ipc_engine_address_is_allowed() -> None:
    assert load(env={"KVD_ENGINE_ADDRESS": "ipc:///tmp/kvd.sock"}).engine_address.startswith(
        "ipc://")


# The messages validate() gave when each rule was written out by hand (a _CHOICES table,
# a _POSITIVE set and one if per field); the schema must refuse the same values, naming
# the field the same way. Bounds now read as the declared range.
@pytest.mark.parametrize("env,message", [
    ({"KVD_DEVICE": "tpu"}, "device: 'tpu' is not one of ('cpu', 'cuda')"),
    ({"KVD_LOG_LEVEL": "loud"},
     "log_level: 'loud' is not one of ('debug', 'info', 'warning', 'error')"),
    ({"KVD_POOL_BACKING": "thp"}, "pool_backing: 'thp' is not one of ('auto', 'hugetlbfs', "
     "'memfd_hugetlb', 'tmpfs_huge', 'shm', 'memfd')"),
    ({"KVD_LEASE_S": "-1"}, "lease_s: must be > 0, got -1.0"),
    ({"KVD_MAX_INFLIGHT_PULLS": "0"}, "max_inflight_pulls: must be > 0, got 0"),
    ({"KVD_CURVE_RELOAD_INTERVAL_S": "0"}, "curve_reload_interval_s: must be > 0, got 0.0"),
    ({"KVD_METRICS_PORT": "70000"}, "metrics_port: must be 0..65535, got 70000"),
    ({"KVD_COPY_THREADS": "17"}, "copy_threads: must be 1..16, got 17"),
    ({"KVD_COPY_THREADS": "0"}, "copy_threads: must be 1..16, got 0"),
    ({"KVD_ENGINE_ADDRESS": "127.0.0.1:7100"},
     "engine_address: '127.0.0.1:7100' must be a tcp:// or ipc:// endpoint"),
    ({"KVD_ENGINE_ADDRESS": ""}, "engine_address: '' must be a tcp:// or ipc:// endpoint"),
    ({"KVD_PEER_ADDRESS": "ipc:///tmp/x"},
     "peer_address: 'ipc:///tmp/x' must be a tcp:// endpoint"),
    ({"KVD_PEER_ADDRESS": "tcp://*:7101"},
     "peer_address: bind an explicit address, not '*' ('tcp://*:7101')"),
    ({"KVD_ADVERTISE_ADDRESS": "tcp://host"},
     "advertise_address: 'tcp://host' must look like tcp://HOST:PORT"),
    ({"KVD_SHM_DIR": "relative"}, "shm_dir: 'relative' is not an existing absolute directory"),
    ({"KVD_POSTING_WORKERS": "17"}, "posting_workers: '17': must be auto or 1..16, got 17"),
    ({"KVD_RAILS": "eth0,eth0"}, "rails: 'eth0,eth0': rails ['eth0', 'eth0'] name a device "
     "twice"),
    ({"KVD_AUTH_TOKEN_FILE": "/nonexistent/token"},
     "auth_token_file: '/nonexistent/token' does not exist"),
    ({"KVD_CURVE_ALLOWLIST": "/nonexistent/allow"},
     "curve_allowlist: '/nonexistent/allow' does not exist"),
    ({"KVD_CURVE_ENGINE_FACE": "1"}, "curve_engine_face / curve_engine_allowlist need "
     "curve_secret_key_file (the daemon's keypair)"),
])
def test_each_declared_rule_refuses_with_its_message(env, message) -> None:
    with pytest.raises(ConfigError) as info:
        load(env=env)
    assert str(info.value) == message


def test_every_knob_is_declared_once_with_help_and_its_rule_reaches_help() -> None:
    """The schema is the one declaration: each field has help, a flag, an environment
    name, and its choices or bounds are said wherever the knob is described."""
    from dataclasses import fields

    from kvd.config import knobs

    assert list(knobs()) == [f.name for f in fields(Config)]
    for knob in knobs().values():
        assert knob.help and knob.default == getattr(Config(), knob.name)
        assert knob.env == f"KVD_{knob.name.upper()}"
        assert knob.flag == "--" + knob.name.replace("_", "-")
        if knob.choices or knob.bounds():
            assert knob.rule() and knob.describe().endswith(knob.rule())
    assert knobs()["device"].choices == ("cpu", "cuda")  # declared order, not sorted
    assert knobs()["lease_s"].bounds() == "> 0" and knobs()["drain_timeout_s"].bounds() == ""


def test_a_bound_of_any_kind_is_said_and_enforced() -> None:
    from kvd.config import Knob

    knob = Knob("x_s", float, 1.0, "X.", ge=1, lt=8)
    assert knob.rule() == "Must be >= 1 and < 8."
    assert knob.refusal(8.0) == "x_s: must be >= 1 and < 8, got 8.0" and knob.refusal(7.5) is None


def test_the_schema_bounds_accept_their_edges() -> None:
    assert load(env={"KVD_COPY_THREADS": "16", "KVD_METRICS_PORT": "0"}).copy_threads == 16
    assert load(env={"KVD_COPY_THREADS": "1", "KVD_METRICS_PORT": "65535"}).metrics_port == 65535

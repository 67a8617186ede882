"""Daemon configuration: one schema, four sources, strict validation at start.

Precedence is flag > environment (``KVD_<FIELD>``) > TOML file > default, so an
operator can ship a ConfigMap and still override one value per pod. Every field
is validated before anything binds, and a bad value names the field and the
source it came from.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvd.errors import ConfigError

ENV_PREFIX = "KVD_"


@dataclass(frozen=True)
class Config:
    """Every knob of ``kvd serve``; the docstring of each field is in FIELD_HELP."""

    engine_address: str = "tcp://127.0.0.1:7100"
    peer_address: str = "tcp://127.0.0.1:7101"
    advertise_address: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 7102
    device: str = "cpu"
    shm_prefix: str = "kvd"
    shm_dir: str = "/dev/shm"
    pool_backing: str = "auto"
    lease_s: float = 30.0
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 60.0
    heartbeat_interval_s: float = 2.0
    peer_liveness_timeout_s: float = 3.0
    drain_timeout_s: float = 30.0
    engine_timeout_s: float = 30.0
    max_message_bytes: int = 16 * 1024 * 1024
    receive_queue_bytes: int = 256 * 1024 * 1024
    max_pool_bytes: int = 1 << 40
    max_blocks_per_request: int = 1 << 20
    max_engines: int = 256
    max_held_requests: int = 100_000
    max_inflight_pulls: int = 4096
    max_quarantined_pulls: int = 64
    max_quarantined_bytes: int = 16 << 30
    nixl_progress_thread: bool = False
    nixl_backend: str = "UCX"
    posting_workers: str = "auto"
    rails: str = "auto"
    copy_threads: int = 2
    host_pulls: bool = True
    log_format: str = "text"
    log_level: str = "info"
    auth_token_file: str = ""
    insecure: bool = False
    curve_secret_key_file: str = ""
    curve_allowlist: str = ""
    curve_engine_face: bool = False
    curve_engine_allowlist: str = ""
    curve_reload_interval_s: float = 1.0

    @property
    def peer_advertise(self) -> str:
        """The address other daemons dial; defaults to the bind address."""
        return self.advertise_address or self.peer_address


FIELD_HELP: dict[str, str] = {
    "engine_address": "ZMQ endpoint (tcp:// or ipc://) where local engines connect.",
    "peer_address": "ZMQ tcp endpoint where other kvd daemons connect.",
    "advertise_address": "Peer address announced to other daemons (default: peer_address).",
    "metrics_host": "Host the Prometheus /metrics, /livez and /readyz server binds.",
    "metrics_port": "Port of the metrics and health server (0 disables it).",
    "device": "Where KV pools live: 'cpu' (POSIX shared memory) or 'cuda' (CUDA IPC).",
    "shm_prefix": "Prefix of shared-memory segment names in shm_dir.",
    "shm_dir": "Directory of the DRAM pools: /dev/shm, or a huge-page mount (hugetlbfs, tmpfs "
               "huge=always) for faster READs; engines must see the same directory.",
    "pool_backing": "Where DRAM pool pages come from: auto (hugetlbfs, then memfd_hugetlb, then "
                    "a huge tmpfs, else 4 KiB shm with a warning), or force one of hugetlbfs, "
                    "memfd_hugetlb, tmpfs_huge, shm (registration fails if the host lacks it), "
                    "or memfd (4 KiB pages without a file; never picked by auto).",
    "lease_s": "Default lease of a published request before its blocks are released.",
    "handshake_timeout_s": "Bound on a peer handshake round trip.",
    "transfer_timeout_s": "Bound on one pull from posting the READs to their completion.",
    "heartbeat_interval_s": "How often a consumer renews leases of requests it is pulling.",
    "peer_liveness_timeout_s": "How soon a partition or a dead peer is noticed: ZMTP "
                               "heartbeats on peer control connections, and UCX's TCP "
                               "keepalive on the data channel (UCX_TCP_KEEPIDLE, _KEEPINTVL, "
                               "_KEEPCNT; an explicit UCX_* variable wins, as on RDMA "
                               "fabrics). A pull from a peer lost this way fails at once, "
                               "and its READs' connections are torn down before its blocks "
                               "are handed back (docs/reliability.md).",
    "engine_timeout_s": "An engine rank silent (no ping) this long is treated as gone.",
    "drain_timeout_s": "On SIGTERM, how long held blocks and in-flight reads may finish.",
    "max_message_bytes": "Largest ZMQ frame accepted on either face (ZMQ_MAXMSGSIZE).",
    "receive_queue_bytes": "Bytes of messages queued per connection on each face before ZMQ "
                           "pushes back (RCVHWM = this / max_message_bytes, at least 8): "
                           "bounds memory under a flood.",
    "max_pool_bytes": "Largest pool one engine rank may ask for; a bigger registration is "
                      "refused with too_large.",
    "max_blocks_per_request": "Most block ids a single publish or pull may name.",
    "max_engines": "Most engine ranks registered at once.",
    "max_held_requests": "Most published requests held at once.",
    "max_inflight_pulls": "Most pulls queued or running at once; more are refused as busy.",
    "max_quarantined_pulls": "Most failed pulls kept quarantined at once (a READ of theirs "
                             "may still land, their blocks are not handed back); past it "
                             "new pulls fail busy before posting.",
    "max_quarantined_bytes": "Most bytes of quarantined pulls; a new pull that would pass "
                             "it fails busy before posting.",
    "nixl_progress_thread": "Run NIXL's progress thread (off by default: it spins a core).",
    "nixl_backend": "NIXL backend plugin to create.",
    "posting_workers": "NIXL agents that post a large pull's READs in parallel, each with its "
                       "own thread and UCX worker, the pull split between them by bytes: "
                       "1..16, or auto (one per rail; without rails the cores available, at "
                       "most 4; 1 on a 1-core host: a single agent).",
    "rails": "Network devices the posting workers are spread over, one UCX device list "
             "each (comma-separated, e.g. mlx5_0:1,mlx5_1:1 or eth1,eth2), 'none', or auto "
             "(the NIC nearest each GPU by PCIe distance; none on a host without GPUs).",
    "copy_threads": "Threads that copy a local pull (producer and consumer engines both on "
                    "this daemon) between their pools, the copy split between them by bytes: "
                    "1..16.",
    "host_pulls": "Pull from another daemon on this host by mapping its DRAM pool files "
                  "and copying (control messages still go to that daemon), when the "
                  "producer daemon says it is on this host and its pools are reachable "
                  "(shared pool directory or IPC namespace); false: always NIXL READs.",
    "log_format": "'text' or 'json' (one JSON object per line).",
    "log_level": "debug, info, warning or error.",
    "auth_token_file": "File holding a shared token that engines and peers must present.",
    "insecure": "Allow non-loopback binds without authentication.",
    "curve_secret_key_file": "This daemon's CURVE keypair (a `kvd keys` NAME.key_secret file, "
                             "mode 0600). Set, the peer face speaks CurveZMQ only: connections "
                             "are encrypted and authenticated by key, the shared token is "
                             "not sent, plaintext peers are refused (docs/security.md).",
    "curve_allowlist": "Public keys allowed to connect with CURVE and accepted as servers: "
                       "a directory of key files (a mounted Secret) or one file. Reloaded "
                       "on change or SIGHUP; a removed key's connections are closed.",
    "curve_engine_face": "Also run CURVE on the engine face when it is bound off loopback "
                         "(engines then need a keypair; loopback and ipc:// unchanged).",
    "curve_engine_allowlist": "Engine public keys allowed on a CURVE engine face (default: "
                              "curve_allowlist).",
    "curve_reload_interval_s": "How often the allowlists are checked for change.",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("cpu", "cuda"),
    "pool_backing": ("auto", "hugetlbfs", "memfd_hugetlb", "tmpfs_huge", "shm", "memfd"),
    "log_format": ("text", "json"),
    "log_level": ("debug", "info", "warning", "error"),
}
_POSITIVE = {
    "lease_s",
    "handshake_timeout_s",
    "transfer_timeout_s",
    "heartbeat_interval_s",
    "peer_liveness_timeout_s",
    "engine_timeout_s",
    "max_message_bytes",
    "receive_queue_bytes",
    "max_pool_bytes",
    "max_blocks_per_request",
    "max_engines",
    "max_held_requests",
    "max_inflight_pulls",
    "max_quarantined_pulls",
    "max_quarantined_bytes",
    "curve_reload_interval_s",
}


def _coerce(name: str, typ: type, raw: Any, source: str) -> Any:
    """Convert a value from a string source (env, flag) or TOML to the field's type."""
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ is int:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(raw)
        if typ is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        if typ is str:
            if not isinstance(raw, str):
                raise ValueError(raw)
            return raw
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{name}: {raw!r} from {source} is not a valid {typ.__name__}")


def field_types() -> dict[str, type]:
    """Every Config field and its type: the schema the CLI flags are generated from."""
    hints = {"str": str, "int": int, "float": float, "bool": bool}
    return {f.name: hints[f.type] for f in fields(Config) if f.type in hints}


def _validate_endpoint(name: str, value: str, allow_ipc: bool) -> None:
    if value.startswith("tcp://"):
        host, _, port = value[6:].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{name}: {value!r} must look like tcp://HOST:PORT")
        if host == "*":
            raise ConfigError(f"{name}: bind an explicit address, not '*' ({value!r})")
        return
    if allow_ipc and value.startswith("ipc://") and len(value) > 6:
        return
    kinds = "tcp:// or ipc://" if allow_ipc else "tcp://"
    raise ConfigError(f"{name}: {value!r} must be a {kinds} endpoint")


DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:7100"


def client_engine_address(given: str | None, env: dict[str, str] | None = None,
                          name: str = "--address") -> str:
    """The engine face a client dials: ``given``, else ``KVD_ENGINE_ADDRESS``, else the
    default. ``host:port`` means ``tcp://host:port``; an empty or malformed value is one
    ``ConfigError`` naming where it came from (``name``: the flag or key that gave it)."""
    env = dict(os.environ) if env is None else env
    if given is not None:
        source, value = name, given
    elif "KVD_ENGINE_ADDRESS" in env:
        source, value = "KVD_ENGINE_ADDRESS", env["KVD_ENGINE_ADDRESS"]
    else:
        return DEFAULT_ENGINE_ADDRESS
    value = value.strip()
    if not value:
        raise ConfigError(f"{source} is empty: give tcp://HOST:PORT or ipc://PATH "
                          f"(unset, it is {DEFAULT_ENGINE_ADDRESS})")
    if "://" not in value:
        value = "tcp://" + value
    _validate_endpoint(source, value, allow_ipc=True)
    return value


MAX_POSTING_WORKERS = 16
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def parse_rails(setting: str) -> list[str] | None:
    """The ``rails`` field: device names, [] for none, None for "auto" (kvd.transport.rails
    detects them). Raises ValueError naming a malformed device."""
    text = setting.strip()
    if text == "auto":
        return None
    if text in ("", "none"):
        return []
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if not _DEVICE_NAME.match(n):
            raise ValueError(f"rail {n!r} is not a device name (e.g. mlx5_0:1, eth1)")
    if len(set(names)) != len(names):
        raise ValueError(f"rails {names} name a device twice")
    if len(names) > MAX_POSTING_WORKERS:
        raise ValueError(f"at most {MAX_POSTING_WORKERS} rails, got {len(names)}")
    return names


def parse_workers(setting: str) -> int | None:
    """The ``posting_workers`` field: a count in 1..16, or None for "auto"."""
    text = setting.strip()
    if text == "auto":
        return None
    n = int(text)
    if not 1 <= n <= MAX_POSTING_WORKERS:
        raise ValueError(f"must be auto or 1..{MAX_POSTING_WORKERS}, got {n}")
    return n


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first invalid field; return cfg unchanged otherwise."""
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"{name}: {getattr(cfg, name)!r} is not one of {choices}")
    for name in _POSITIVE:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name}: must be > 0, got {getattr(cfg, name)!r}")
    if not 0 <= cfg.metrics_port < 65536:
        raise ConfigError(f"metrics_port: {cfg.metrics_port} is not a port")
    _validate_endpoint("engine_address", cfg.engine_address, allow_ipc=True)
    _validate_endpoint("peer_address", cfg.peer_address, allow_ipc=False)
    if cfg.advertise_address:
        _validate_endpoint("advertise_address", cfg.advertise_address, allow_ipc=False)
    if cfg.heartbeat_interval_s >= cfg.lease_s:
        raise ConfigError(
            f"heartbeat_interval_s ({cfg.heartbeat_interval_s}) must be shorter than "
            f"lease_s ({cfg.lease_s}) or leases expire between heartbeats"
        )
    if cfg.lease_s <= cfg.heartbeat_interval_s + cfg.peer_liveness_timeout_s:
        # A consumer stalled just under the liveness timeout is not noticed as stalled,
        # and its next renewal comes up to a heartbeat later: a shorter lease can lapse
        # first, the producer's engine reuses the blocks, and the pull reads them.
        raise ConfigError(
            f"lease_s ({cfg.lease_s}) must be longer than heartbeat_interval_s "
            f"({cfg.heartbeat_interval_s}) + peer_liveness_timeout_s "
            f"({cfg.peer_liveness_timeout_s}), or a lease can lapse under a pull whose "
            "consumer stalled without being noticed"
        )
    if not Path(cfg.shm_dir).is_absolute() or not Path(cfg.shm_dir).is_dir():
        raise ConfigError(f"shm_dir: {cfg.shm_dir!r} is not an existing absolute directory")
    for name, parse in (("posting_workers", parse_workers), ("rails", parse_rails)):
        try:
            parse(getattr(cfg, name))
        except ValueError as exc:
            raise ConfigError(f"{name}: {getattr(cfg, name)!r}: {exc}") from None
    if not 1 <= cfg.copy_threads <= 16:
        raise ConfigError(f"copy_threads: must be 1..16, got {cfg.copy_threads!r}")
    if cfg.auth_token_file and not Path(cfg.auth_token_file).is_file():
        raise ConfigError(f"auth_token_file: {cfg.auth_token_file!r} does not exist")
    if cfg.curve_secret_key_file and not cfg.curve_allowlist:
        raise ConfigError("curve_allowlist: required with curve_secret_key_file (the public "
                          "keys of the daemons this one talks to)")
    for name in ("curve_secret_key_file", "curve_allowlist", "curve_engine_allowlist"):
        if getattr(cfg, name) and not Path(getattr(cfg, name)).exists():
            raise ConfigError(f"{name}: {getattr(cfg, name)!r} does not exist")
    if (cfg.curve_engine_face or cfg.curve_engine_allowlist) and not cfg.curve_secret_key_file:
        raise ConfigError("curve_engine_face / curve_engine_allowlist need "
                          "curve_secret_key_file (the daemon's keypair)")
    return cfg


def load(
    path: str | Path | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Merge file, environment and flag overrides (None means 'not given') and validate."""
    types = field_types()
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: {exc}") from None
        table = data.get("kvd", data)
        for key, raw in table.items():
            if key not in types:
                raise ConfigError(f"config file {str(path)!r}: unknown key {key!r}")
            values[key] = _coerce(key, types[key], raw, f"file {path}")
    env = os.environ if env is None else env
    for key, typ in types.items():
        raw = env.get(ENV_PREFIX + key.upper())
        if raw is not None:
            values[key] = _coerce(key, typ, raw, f"env {ENV_PREFIX + key.upper()}")
    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in types:
            raise ConfigError(f"unknown option {key!r}")
        values[key] = _coerce(key, types[key], raw, f"flag --{key.replace('_', '-')}")
    return validate(replace(Config(), **values))

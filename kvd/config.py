"""Daemon configuration: one schema, four sources, strict validation at start.

``Config`` is the schema: each knob is declared once, as a field whose annotation
carries its type, its bounds or choices, and its help (``Annotated[..., Meta(...)]``,
as kvd.wire.protocol declares messages). ``KNOBS`` reads that declaration once, and
everything else is derived from it: validation (``validate``), the ``kvd serve`` flags
and ``--set`` (kvd.cli), the ``KVD_*`` environment names and docs/configuration.md
(scripts/gen_docs.py). Adding a knob is adding a field.

Precedence is flag > environment (``KVD_<FIELD>``) > TOML file > default, so an
operator can ship a ConfigMap and still override one value per pod. Every field
is validated before anything binds, and a bad value names the field and the source
it came from.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec.inspect
from msgspec import Meta

from kvd.errors import ConfigError

ENV_PREFIX = "KVD_"
DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:7100"
MAX_POSTING_WORKERS = 16
MAX_COPY_THREADS = 16

# Kinds of value that a type and bounds cannot say; each names a check in _CHECKS.
# A string knob whose default is empty is unset when empty, and then not checked.
Endpoint = Annotated[str, Meta(extra={"check": "endpoint"})]  # tcp:// or ipc://
TcpEndpoint = Annotated[str, Meta(extra={"check": "tcp_endpoint"})]
Directory = Annotated[str, Meta(extra={"check": "directory"})]  # absolute, existing
File = Annotated[str, Meta(extra={"check": "file"})]  # an existing file
FileOrDirectory = Annotated[str, Meta(extra={"check": "path"})]  # an existing path
Positive = Meta(gt=0)


@dataclass(frozen=True)
class Config:
    """Every knob of ``kvd serve``: its type, bounds or choices, default and help."""

    engine_address: Annotated[Endpoint, Meta(
        description="ZMQ endpoint (tcp:// or ipc://) where local engines connect.",
    )] = DEFAULT_ENGINE_ADDRESS
    engine_direct: Annotated[bool, Meta(
        description="Also serve engines of this host on a Unix socket in the abstract "
                    "namespace named after engine_address (kvd-engine-tcp-<port>; Linux, "
                    "not with CURVE on the engine face). kvd's engine clients use it "
                    "when they find it: a message then goes from the engine thread that "
                    "sends it into the kernel, not through ZMQ's I/O threads, which "
                    "wait behind the engine's computing threads on a busy host "
                    "(docs/architecture.md). Same requests, token and bounds.",
    )] = True
    peer_address: Annotated[TcpEndpoint, Meta(
        description="ZMQ tcp endpoint where other kvd daemons connect.",
    )] = "tcp://127.0.0.1:7101"
    advertise_address: Annotated[TcpEndpoint, Meta(
        description="Peer address announced to other daemons (default: peer_address).",
    )] = ""
    metrics_host: Annotated[str, Meta(
        description="Host the Prometheus /metrics, /livez and /readyz server binds.",
    )] = "127.0.0.1"
    metrics_port: Annotated[int, Meta(
        ge=0, le=65535,
        description="Port of the metrics and health server (0 disables it).",
    )] = 7102
    device: Annotated[Literal["cpu", "cuda"], Meta(
        description="Where KV pools live: 'cpu' (POSIX shared memory) or 'cuda' (CUDA IPC).",
    )] = "cpu"
    shm_prefix: Annotated[str, Meta(
        description="Prefix of shared-memory segment names in shm_dir.",
    )] = "kvd"
    shm_dir: Annotated[Directory, Meta(
        description="Directory of the DRAM pools: /dev/shm, or a huge-page mount (hugetlbfs, "
                    "tmpfs huge=always) for faster READs; engines must see the same directory.",
    )] = "/dev/shm"
    pool_backing: Annotated[Literal["auto", "hugetlbfs", "memfd_hugetlb", "tmpfs_huge", "shm",
                                    "memfd"], Meta(
        description="Where DRAM pool pages come from: auto (hugetlbfs, then memfd_hugetlb, "
                    "then a huge tmpfs, else 4 KiB shm with a warning), or force one of "
                    "hugetlbfs, memfd_hugetlb, tmpfs_huge, shm (registration fails if the "
                    "host lacks it), or memfd (4 KiB pages without a file; never picked by "
                    "auto).",
    )] = "auto"
    lease_s: Annotated[float, Positive, Meta(
        description="Default lease of a published request before its blocks are released.",
    )] = 30.0
    handshake_timeout_s: Annotated[float, Positive, Meta(
        description="Bound on a peer handshake round trip.",
    )] = 5.0
    transfer_timeout_s: Annotated[float, Positive, Meta(
        description="Bound on one pull from posting the READs to their completion.",
    )] = 60.0
    progressive_hold_s: Annotated[float, Positive, Meta(
        description="How long a progressive pull waits for its producer's first seal, "
                    "and then for each next one, before it fails (Pull.hold_timeout_s "
                    "overrides it per pull).",
    )] = 30.0
    heartbeat_interval_s: Annotated[float, Positive, Meta(
        description="How often a consumer renews leases of requests it is pulling.",
    )] = 2.0
    peer_liveness_timeout_s: Annotated[float, Positive, Meta(
        description="How soon a partition or a dead peer is noticed: ZMTP heartbeats on "
                    "peer control connections, and UCX's TCP keepalive on the data channel "
                    "(UCX_TCP_KEEPIDLE, _KEEPINTVL, _KEEPCNT; an explicit UCX_* variable "
                    "wins, as on RDMA fabrics). A pull from a peer lost this way fails at "
                    "once, and its READs' connections are torn down before its blocks are "
                    "handed back (docs/reliability.md).",
    )] = 3.0
    drain_timeout_s: Annotated[float, Meta(
        description="On SIGTERM, how long held blocks and in-flight reads may finish.",
    )] = 30.0
    engine_timeout_s: Annotated[float, Positive, Meta(
        description="An engine rank silent (no ping) this long is treated as gone.",
    )] = 30.0
    max_message_bytes: Annotated[int, Positive, Meta(
        description="Largest ZMQ frame accepted on either face (ZMQ_MAXMSGSIZE).",
    )] = 16 * 1024 * 1024
    receive_queue_bytes: Annotated[int, Positive, Meta(
        description="Bytes of messages queued per connection on each face before ZMQ "
                    "pushes back (RCVHWM = this / max_message_bytes, at least 8): bounds "
                    "memory under a flood.",
    )] = 256 * 1024 * 1024
    max_pool_bytes: Annotated[int, Positive, Meta(
        description="Largest pool one engine rank may ask for; a bigger registration is "
                    "refused with too_large.",
    )] = 1 << 40
    max_blocks_per_request: Annotated[int, Positive, Meta(
        description="Most block ids a single publish or pull may name.",
    )] = 1 << 20
    max_engines: Annotated[int, Positive, Meta(
        description="Most engine ranks registered at once.",
    )] = 256
    max_held_requests: Annotated[int, Positive, Meta(
        description="Most published requests held at once.",
    )] = 100_000
    max_inflight_pulls: Annotated[int, Positive, Meta(
        description="Most pulls queued or running at once; more are refused as busy.",
    )] = 4096
    max_quarantined_pulls: Annotated[int, Positive, Meta(
        description="Most failed pulls kept quarantined at once (a READ of theirs may still "
                    "land, their blocks are not handed back); past it new pulls fail busy "
                    "before posting.",
    )] = 64
    max_quarantined_bytes: Annotated[int, Positive, Meta(
        description="Most bytes of quarantined pulls; a new pull that would pass it fails "
                    "busy before posting.",
    )] = 16 << 30
    nixl_progress_thread: Annotated[bool, Meta(
        description="Run NIXL's progress thread (off by default: it spins a core).",
    )] = False
    nixl_backend: Annotated[str, Meta(
        description="NIXL backend plugin to create.",
    )] = "UCX"
    posting_workers: Annotated[str, Meta(
        extra={"check": "posting_workers"},
        description="NIXL agents that post a large pull's READs in parallel, each with its "
                    "own thread and UCX worker, the pull split between them by bytes: "
                    "1..16, or auto (one per rail; without rails the cores available, at "
                    "most 4; 1 on a 1-core host: a single agent).",
    )] = "auto"
    rails: Annotated[str, Meta(
        extra={"check": "rails"},
        description="Network devices the posting workers are spread over, one UCX device "
                    "list each (comma-separated, e.g. mlx5_0:1,mlx5_1:1 or eth1,eth2), "
                    "'none', or auto (the NIC nearest each GPU by PCIe distance; none on a "
                    "host without GPUs).",
    )] = "auto"
    copy_threads: Annotated[int, Meta(
        ge=1, le=MAX_COPY_THREADS,
        description="Threads that copy a local pull (producer and consumer engines both on "
                    "this daemon) between their pools, the copy split between them by "
                    "bytes.",
    )] = 2
    copy_bursts: Annotated[bool, Meta(
        description="Experimental: local and same-host pulls that arrive together (read "
                    "while more requests wait on the engine face) copy together once the "
                    "face has read them, so their events leave in one reply. Measured "
                    "slower under CPU starvation (each queued pull then runs as a task: "
                    "about twice the daemon CPU per pull); false: each small pull copies "
                    "inline as it is read.",
    )] = False
    cpu_nice: Annotated[int, Meta(
        ge=-20, le=19,
        description="The daemon's CPU priority (nice value, every thread of it), set at "
                    "start. Its work is short and on every hand-over's path, and its "
                    "CPU use small (~0.03 core idle): ahead of threads that compute "
                    "(engines, other work), a pull waits less for a CPU on a busy "
                    "host. A daemon leading its session sets its autogroup too "
                    "(docs/operations.md). A value below the current one needs "
                    "CAP_SYS_NICE or RLIMIT_NICE (docs/operations.md): without them "
                    "the daemon logs a warning and runs as started; 0: left as started.",
    )] = -10
    prefault_pools: Annotated[bool, Meta(
        description="Map every page of each DRAM pool the daemon creates ahead of traffic "
                    "(a thread after registration), so that a pull into blocks "
                    "never used before does not fault them in one by one on its path (a "
                    "first touch also zeroes the page). false: pages fault in as used.",
    )] = True
    host_pulls: Annotated[bool, Meta(
        description="Pull from another daemon on this host by mapping its DRAM pool files "
                    "and copying (control messages still go to that daemon), when the "
                    "producer daemon says it is on this host and its pools are reachable "
                    "(shared pool directory or IPC namespace); false: always NIXL READs.",
    )] = True
    otel_traces: Annotated[bool, Meta(
        description="Export OpenTelemetry spans of every traced hold and pull (needs "
                    "`pip install 'kvd[otel]'`): to OTEL_EXPORTER_OTLP_ENDPOINT (or "
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) over OTLP/HTTP, sampled by "
                    "OTEL_TRACES_SAMPLER_ARG (a ratio, under the request's own sampling "
                    "decision); false: nothing of OpenTelemetry is imported "
                    "(docs/operations.md, Tracing).",
    )] = False
    log_format: Annotated[Literal["text", "json"], Meta(
        description="How log lines are written; json: one JSON object per line.",
    )] = "text"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(
        description="The least severe level logged.",
    )] = "info"
    auth_token_file: Annotated[File, Meta(
        description="File holding a shared token that engines and peers must present.",
    )] = ""
    insecure: Annotated[bool, Meta(
        description="Allow non-loopback binds without authentication.",
    )] = False
    curve_secret_key_file: Annotated[FileOrDirectory, Meta(
        description="This daemon's CURVE keypair (a `kvd keys` NAME.key_secret file, mode "
                    "0600). Set, the peer face speaks CurveZMQ only: connections are "
                    "encrypted and authenticated by key, the shared token is not sent, "
                    "plaintext peers are refused (docs/security.md).",
    )] = ""
    curve_allowlist: Annotated[FileOrDirectory, Meta(
        description="Public keys allowed to connect with CURVE and accepted as servers: a "
                    "directory of key files (a mounted Secret) or one file. Reloaded on "
                    "change or SIGHUP; a removed key's connections are closed.",
    )] = ""
    curve_engine_face: Annotated[bool, Meta(
        description="Also run CURVE on the engine face when it is bound off loopback "
                    "(engines then need a keypair; loopback and ipc:// unchanged).",
    )] = False
    curve_engine_allowlist: Annotated[FileOrDirectory, Meta(
        description="Engine public keys allowed on a CURVE engine face (default: "
                    "curve_allowlist).",
    )] = ""
    curve_reload_interval_s: Annotated[float, Positive, Meta(
        description="How often the allowlists are checked for change.",
    )] = 1.0

    @property
    def peer_advertise(self) -> str:
        """The address other daemons dial; defaults to the bind address."""
        return self.advertise_address or self.peer_address


_BASE_TYPES: dict[type, type] = {
    msgspec.inspect.StrType: str,
    msgspec.inspect.IntType: int,
    msgspec.inspect.FloatType: float,
    msgspec.inspect.BoolType: bool,
    msgspec.inspect.LiteralType: str,
}


@dataclass(frozen=True)
class Knob:
    """One knob as ``Config`` declares it, read once by ``knobs()``."""

    name: str
    type: type  # str, int, float or bool: what a string from env or a flag becomes
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    check: str = ""  # a key of _CHECKS

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        """"> 0", "1..16" (both ends included), ">= 1 and < 8", or "" (no bound)."""
        if self.ge is not None and self.le is not None and self.gt is self.lt is None:
            return f"{self.ge}..{self.le}"
        return " and ".join(f"{op} {v}" for op, v in ((">", self.gt), (">=", self.ge),
                                                      ("<", self.lt), ("<=", self.le))
                            if v is not None)

    def rule(self, quote: Callable[[str], str] = str) -> str:
        """What a value must be, as a sentence for --help and the reference ("" if any
        value of its type will do)."""
        if self.choices:
            return "One of: " + ", ".join(quote(c) for c in self.choices) + "."
        return f"Must be {self.bounds()}." if self.bounds() else ""

    def describe(self, quote: Callable[[str], str] = str) -> str:
        """The help and the rule: what --help and docs/configuration.md say of the knob."""
        return f"{self.help} {self.rule(quote)}".rstrip()

    def refusal(self, value: Any) -> str | None:
        """Why ``value`` breaks the declared choices or bounds, or None."""
        if self.choices and value not in self.choices:
            return f"{self.name}: {value!r} is not one of {self.choices}"
        if ((self.gt is not None and not value > self.gt)
                or (self.ge is not None and not value >= self.ge)
                or (self.lt is not None and not value < self.lt)
                or (self.le is not None and not value <= self.le)):
            return f"{self.name}: must be {self.bounds()}, got {value!r}"
        return None


def _knob(field: msgspec.inspect.Field, declared: Any) -> Knob:
    info = field.type
    if not isinstance(info, msgspec.inspect.Metadata) or not (info.extra_json_schema or {}).get(
            "description"):
        raise TypeError(f"Config.{field.name} declares no help (Meta(description=...))")
    kind = info.type
    # msgspec sorts a Literal's values; the choices keep the order they are declared in.
    while typing.get_origin(declared) is Annotated:
        declared = typing.get_args(declared)[0]
    choices = typing.get_args(declared) if typing.get_origin(declared) is Literal else ()
    return Knob(name=field.name, type=_BASE_TYPES[type(kind)], default=field.default,
                help=info.extra_json_schema["description"], choices=choices,
                gt=getattr(kind, "gt", None), ge=getattr(kind, "ge", None),
                lt=getattr(kind, "lt", None), le=getattr(kind, "le", None),
                check=(info.extra or {}).get("check", ""))


def knobs() -> dict[str, Knob]:
    """Every knob, in declaration order (the order of --help and the reference)."""
    if not _KNOBS:
        hints = typing.get_type_hints(Config, include_extras=True)
        _KNOBS.update((f.name, _knob(f, hints[f.name]))
                      for f in msgspec.inspect.type_info(Config).fields)
    return _KNOBS


_KNOBS: dict[str, Knob] = {}


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


_DEVICE_NAME = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def parse_rails(setting: str) -> list[str] | None:
    """The ``rails`` field: device names, [] for none, None for "auto" (kvd.transport.remote.rails
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


def _check_path(kind: str) -> Callable[[str, str], None]:
    def check(name: str, value: str) -> None:
        path = Path(value)
        if kind == "directory" and not (path.is_absolute() and path.is_dir()):
            raise ConfigError(f"{name}: {value!r} is not an existing absolute directory")
        if (kind == "file" and not path.is_file()) or (kind == "path" and not path.exists()):
            raise ConfigError(f"{name}: {value!r} does not exist")
    return check


def _check_parsed(parse: Callable[[str], object]) -> Callable[[str, str], None]:
    def check(name: str, value: str) -> None:
        try:
            parse(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {value!r}: {exc}") from None
    return check


# The checks a knob names in its declaration (Meta(extra={"check": ...})).
_CHECKS: dict[str, Callable[[str, str], None]] = {
    "endpoint": lambda name, value: _validate_endpoint(name, value, allow_ipc=True),
    "tcp_endpoint": lambda name, value: _validate_endpoint(name, value, allow_ipc=False),
    "directory": _check_path("directory"),
    "file": _check_path("file"),
    "path": _check_path("path"),
    "posting_workers": _check_parsed(parse_workers),
    "rails": _check_parsed(parse_rails),
}


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first invalid field; return cfg unchanged otherwise.

    Each knob first against its declaration (choices, bounds, the check it names), in
    the order of the schema; then the rules between knobs."""
    for knob in knobs().values():
        value = getattr(cfg, knob.name)
        refusal = knob.refusal(value)
        if refusal:
            raise ConfigError(refusal)
        if knob.check and not (value == "" and knob.default == ""):
            _CHECKS[knob.check](knob.name, value)
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
    if cfg.curve_secret_key_file and not cfg.curve_allowlist:
        raise ConfigError("curve_allowlist: required with curve_secret_key_file (the public "
                          "keys of the daemons this one talks to)")
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
    schema = knobs()
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
            if key not in schema:
                raise ConfigError(f"config file {str(path)!r}: unknown key {key!r}")
            values[key] = _coerce(key, schema[key].type, raw, f"file {path}")
    env = os.environ if env is None else env
    for key, knob in schema.items():
        raw = env.get(knob.env)
        if raw is not None:
            values[key] = _coerce(key, knob.type, raw, f"env {knob.env}")
    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in schema:
            raise ConfigError(f"unknown option {key!r}")
        values[key] = _coerce(key, schema[key].type, raw, f"flag {schema[key].flag}")
    return validate(replace(Config(), **values))

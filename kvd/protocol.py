"""Every message kvd sends or receives, and the one place they are decoded.

Wire format (both faces, ZMQ multipart, msgpack via msgspec, never pickle):

    [header, body]     header = Header (msgpack map), body = the struct named by header.kind

The header is decoded first, with a decoder that ignores unknown fields, so a
future version can add header fields (a MAC, a tenant) without breaking older
peers; ``token`` is already there for shared-token authentication. The version
is checked before the body is decoded: a peer speaking another version gets a
clear ``incompatible`` error instead of a decode failure.

NIXL notifications (producer side) carry a ReadNotice, prefixed by NOTICE_MAGIC.

Version history:
    1  initial protocol: engine face (register, publish, pull, poll, status),
       peer face (hello, acquire, heartbeat, abandon), ReadNotice notifications.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvd.errors import ProtocolError

PROTOCOL_VERSION = 1
NOTICE_MAGIC = b"kvd1"

DTYPE_NBYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Stable across versions: only fields may be added, never changed or removed."""

    v: int
    kind: str
    id: int = 0
    token: str = ""


# ---------------------------------------------------------------- geometry


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What must match between a producer and a consumer engine (TP/PP may differ)."""

    name: str
    num_kv_heads: int
    num_layers: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's cache layout; block size and block count may differ between engines."""

    num_blocks: int
    block_size_tokens: int
    kv_layout: str = "kv_split"
    head_layout: str = "HND"


class PoolHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an engine maps the pool kvd allocated for it."""

    kind: Literal["shm", "cuda_ipc"]
    name: str
    nbytes: int
    shape: list[int]
    dtype: str
    ipc_handle: bytes = b""
    device_index: int = -1
    directory: str = "/dev/shm"  # where the shm file lives (Config.shm_dir)


class RankDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tp_rank: int
    pp_rank: int
    base_addr: int
    nbytes: int
    num_blocks: int
    device_id: int = 0


class EngineDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine as one daemon sees it: its geometry and the ranks that daemon hosts."""

    engine_id: str
    model: ModelSpec
    layout: LayoutSpec
    tp_size: int
    pp_size: int
    layer_partition: list[int] | None
    ranks: list[RankDesc]
    mem_type: str = "DRAM"
    epoch: int = 0  # bumps whenever this daemon's set of ranks/pools for the engine changes


# ---------------------------------------------------------------- engine face


class RegisterEngine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    model: ModelSpec
    layout: LayoutSpec
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    layer_partition: list[int] | None = None
    # Peer addresses of every daemon hosting ranks of this engine (an engine may
    # span nodes); empty means "only this daemon".
    engine_daemons: list[str] = []
    device_index: int = 0  # GPU of this rank when the daemon runs with device="cuda"


class Registered(msgspec.Struct, frozen=True):
    pool: PoolHandle
    daemon_id: str
    peer_address: str


class Deregister(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    tp_rank: int
    pp_rank: int = 0


class Ping(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine liveness: a rank not heard from for engine_timeout_s is considered gone."""

    engine_id: str
    tp_rank: int
    pp_rank: int = 0


class Publish(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    request_id: str
    block_ids: list[int]
    lease_s: float | None = None
    consumers: int = 1


class Pull(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Read a published request into local blocks.

    ``request_id`` names the pull on this engine (its done_recving event carries
    it); ``remote_request_id`` is the id the producer published under, when it
    differs (vLLM gives prefill and decode requests different ids; two prefill
    engines may publish the same id). Empty means "the same as request_id".
    """

    engine_id: str
    request_id: str
    remote_engine_id: str
    remote_address: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    remote_request_id: str = ""

    @property
    def producer_request_id(self) -> str:
        return self.remote_request_id or self.request_id


class Poll(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Long poll for completion events of an engine; answered as soon as any exist."""

    engine_id: str
    timeout_s: float = 1.0
    max_events: int = 1024


class Event(msgspec.Struct, frozen=True):
    kind: Literal["done_sending", "done_recving"]
    request_id: str
    ok: bool
    invalid_block_ids: list[int] = []
    error: str = ""
    nbytes: int = 0
    duration_s: float = 0.0


class Events(msgspec.Struct, frozen=True):
    events: list[Event]


class StatusQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class Status(msgspec.Struct, frozen=True):
    daemon_id: str
    version: str
    draining: bool
    engines: list[dict[str, Any]]
    peers: list[dict[str, Any]]
    held: list[dict[str, Any]]
    pulls: list[dict[str, Any]]


# ---------------------------------------------------------------- peer face


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consumer daemon -> producer daemon, once per (local engine, remote engine)."""

    daemon_id: str
    remote_engine_id: str
    consumer: EngineDesc
    agent_metadata: bytes
    compat_hash: str


class HelloReply(msgspec.Struct, frozen=True):
    daemon_id: str
    agent_name: str
    agent_metadata: bytes
    engine: EngineDesc
    engine_daemons: list[str]


class Acquire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Before posting READs: is the request still held, with these blocks? Renews its lease."""

    request_id: str
    producer_engine_id: str
    consumer_engine_id: str
    block_ids: list[int]


class Acquired(msgspec.Struct, frozen=True):
    """The request is held; ``epoch`` lets the consumer detect a stale cached handshake."""

    epoch: int


class Abandon(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The consumer gave up after Acquire and its READs are released: stop holding for it."""

    request_id: str
    producer_engine_id: str
    consumer_engine_id: str


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    producer_engine_id: str
    request_ids: list[str]


class HeartbeatAck(msgspec.Struct, frozen=True):
    unknown: list[str]


# ---------------------------------------------------------------- replies


class Ok(msgspec.Struct, frozen=True):
    pass


class Error(msgspec.Struct, frozen=True):
    code: str
    message: str


class ReadNotice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Rides on a READ's NIXL notification: 'these plan reads of the request are done'."""

    request_id: str
    producer_engine_id: str
    consumer_engine_id: str
    reads: int
    nbytes: int = 0  # bytes those reads copied out of this daemon's pools (for metrics)


ENGINE_REQUESTS = (RegisterEngine, Deregister, Ping, Publish, Pull, Poll, StatusQuery)
PEER_REQUESTS = (Hello, Acquire, Heartbeat, Abandon)
REPLIES = (Registered, Events, Status, HelloReply, Acquired, HeartbeatAck, Ok, Error)
ALL_MESSAGES = ENGINE_REQUESTS + PEER_REQUESTS + REPLIES

_KIND = {cls: cls.__name__ for cls in ALL_MESSAGES}
_header_decoder = msgspec.msgpack.Decoder(Header)
_decoders = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in ALL_MESSAGES}
_notice_decoder = msgspec.msgpack.Decoder(ReadNotice)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct, msg_id: int = 0, token: str = "") -> list[bytes]:
    """Two frames: header then body."""
    header = Header(v=PROTOCOL_VERSION, kind=_KIND[type(msg)], id=msg_id, token=token)
    return [_encoder.encode(header), _encoder.encode(msg)]


def decode_header(frame: bytes) -> Header:
    try:
        header = _header_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ProtocolError(f"malformed header: {exc}") from None
    return header


def decode(frames: list[bytes], allowed: tuple[type, ...]) -> tuple[Header, Any]:
    """The single decode boundary: frames -> (header, body) or ProtocolError.

    Raises ProtocolError with ``reason`` set to decode|version|unknown so the
    caller can count it. The version check comes before the body is touched.
    """
    if len(frames) != 2:
        raise _reason(ProtocolError(f"expected 2 frames, got {len(frames)}"), "decode")
    header = decode_header(frames[0])
    if header.v != PROTOCOL_VERSION:
        err = ProtocolError(
            f"protocol version {header.v} not supported (this daemon speaks {PROTOCOL_VERSION})"
        )
        err.code = "incompatible"
        raise _reason(err, "version")
    decoder = _decoders.get(header.kind)
    if decoder is None or not any(cls.__name__ == header.kind for cls in allowed):
        raise _reason(ProtocolError(f"unknown message kind {header.kind[:64]!r}"), "unknown")
    try:
        return header, decoder.decode(frames[1])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise _reason(ProtocolError(f"malformed {header.kind}: {exc}"), "decode") from None


def _reason(err: ProtocolError, reason: str) -> ProtocolError:
    err.reason = reason  # type: ignore[attr-defined]
    return err


def encode_notice(notice: ReadNotice) -> bytes:
    return NOTICE_MAGIC + _encoder.encode(notice)


def decode_notice(raw: bytes) -> ReadNotice:
    if not raw.startswith(NOTICE_MAGIC):
        raise ProtocolError("notification without kvd magic")
    try:
        return _notice_decoder.decode(raw[len(NOTICE_MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ProtocolError(f"malformed notification: {exc}") from None


def schema() -> dict[str, Any]:
    """JSON Schema of every message, the language-neutral form kept in proto/."""
    _, components = msgspec.json.schema_components(
        (Header, ReadNotice, *ALL_MESSAGES), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvd wire protocol",
        "protocol_version": PROTOCOL_VERSION,
        "frames": ["Header", "body named by Header.kind"],
        "engine_requests": [c.__name__ for c in ENGINE_REQUESTS],
        "peer_requests": [c.__name__ for c in PEER_REQUESTS],
        "replies": [c.__name__ for c in REPLIES],
        "notification": {"prefix": NOTICE_MAGIC.decode(), "body": "ReadNotice"},
        "$defs": components,
    }

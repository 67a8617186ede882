"""Every message kvd sends or receives, and the one place they are decoded.

Both faces: ZMQ multipart ``[header, body]``, msgpack via msgspec, never pickle; the
header is decoded and checked first (kvd.wire.codec).

The protocol's one description, its error codes and its version history (what each
addition means for older peers): proto/README.md. PROTOCOL_VERSION below is the
version; bump it, and add a row there, for anything an older peer would reject.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Literal

import msgspec

from kvd.errors import ProtocolError  # noqa: F401 - re-exported: callers catch P.ProtocolError
from kvd.wire.codec import Codec

PROTOCOL_VERSION = 3
# The oldest version a receiver still accepts: v3 only adds an optional field (a trace
# context), omitted at its default. A message is sent as the oldest version that carries
# it (`_stamp`): v2 unless it carries a trace context, so v2 peers keep working.
MIN_PROTOCOL_VERSION = 2
DRAM_DEVICE_INDEX = -1  # RegisterEngine.device_index of a rank whose pool is DRAM
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

# Bounds at the decode boundary (a header is a few dozen bytes; a peer cannot make the
# daemon walk a deep or huge one, and every wait a request names is finite).
MAX_HEADER_BYTES = 4096
MAX_TIMEOUT_S = 86_400.0
MAX_LEASE_S = 3600.0
MAX_CONSUMERS = 1024
MAX_POLL_EVENTS = 10_000
MAX_HEARTBEAT_IDS = 4096
MAX_ID_CHARS = 256
MAX_ADDRESS_CHARS = 1024  # a daemon's peer address (tcp://host:port, ipc://path)
MAX_WARM_PRODUCERS = 1024
MAX_RECEIPT_CHARS = 128  # Published.receipt: "<instance id>/<hold id>"
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]  # engine, request
TimeoutS = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIMEOUT_S)]
# A W3C trace context header value (https://www.w3.org/TR/trace-context/#traceparent-header),
# version 00: "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>"; "" for none.
TRACEPARENT_PATTERN = "^(00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?$"
Traceparent = Annotated[str, msgspec.Meta(max_length=55, pattern=TRACEPARENT_PATTERN)]


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Stable across versions: only fields may be added, never changed or removed."""

    v: int
    kind: str
    id: int = 0
    token: str = ""
    instance: str = ""  # the sending daemon's incarnation (random per process); clients: ""


# ---------------------------------------------------------------- geometry


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One layer of a hybrid model: its cache kind (``none``: MLP/MoE, no cache)."""

    kind: Literal["attention", "sliding", "mamba", "none"]
    window_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # sliding only


class MambaSpecMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """State shapes of the Mamba2 mixers (kvd.planner.mamba.MambaSpec on the wire)."""

    num_heads: Annotated[int, msgspec.Meta(ge=1)]
    head_dim: Annotated[int, msgspec.Meta(ge=1)]
    n_groups: Annotated[int, msgspec.Meta(ge=0)]
    d_state: Annotated[int, msgspec.Meta(ge=1)]
    conv_kernel: Annotated[int, msgspec.Meta(ge=2)]
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "bfloat16"


class HybridSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A hybrid model's layers and KV-cache groups; attention geometry stays in ModelSpec.

    One entry per layer (``ModelSpec.num_layers`` of them); ``groups`` lists each
    KV-cache group's global layer indices, so requests carry one block-id list per
    group in this order. The engine's pool is vLLM's hybrid layout (one tensor per
    layer position shared by every group, blocks_first attention pages, Mamba slots
    of ``ratio`` pages); ``LayoutSpec.num_blocks`` counts logical blocks and
    ``block_size_tokens`` is the attention kernel block.
    """

    layers: list[LayerSpec]
    groups: list[list[int]]
    mamba: MambaSpecMsg | None = None
    conv_layout: Literal["DS", "SD"] = "DS"


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What must match between a producer and a consumer engine (TP/PP may differ)."""

    name: str
    num_kv_heads: int
    num_layers: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False
    hybrid: HybridSpec | None = None  # attention + sliding + Mamba layers, several groups


AUTO_KV_LAYOUT = "auto"  # LayoutSpec.kv_layout: the engine's daemon picks the layout


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's cache layout; block size and block count may differ between engines.

    ``kv_layout`` defaults to ``auto``: the daemon the rank registers with resolves it
    to the layout with the fewest descriptors that the model and ``head_layout`` allow
    (kvd.daemon.engines.table.auto_kv_layout: head_major for plain HND attention, cross_layer
    for NHD and MLA, LBHNC/LBNHC for hybrid models; table in docs/engine-api.md) and
    answers with it in ``Registered.layout``. The resolution depends on the model and
    ``head_layout`` only, never on TP, PP or block size, so two daemons resolve two
    engines that may pair alike; peers only ever see the resolved name (``EngineDesc``,
    the compatibility hash). vLLM's engines send their own layout (kv_split, LBHNC, ...).
    """

    num_blocks: int
    block_size_tokens: int
    kv_layout: str = AUTO_KV_LAYOUT
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


class RegisterEngine(msgspec.Struct, frozen=True, forbid_unknown_fields=True,
                     omit_defaults=True):
    engine_id: Id
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
    # GPU of this rank when the daemon runs with device="cuda"; DRAM_DEVICE_INDEX (-1):
    # none, the rank's pool is DRAM (shared memory) on such a daemon too, so that a GPU
    # node's daemon also hosts engines that keep KV in host memory.
    device_index: int = 0
    # A pool this rank still maps from a previous daemon incarnation (the handle that
    # daemon gave): the new daemon takes it over instead of allocating, so the engine
    # keeps its KV memory across a daemon restart. Only DRAM pools (shm files in the
    # daemon's shm_dir, memfds as /proc/<pid>/fd/<n>); VRAM pools are refused
    # (docs/operations.md). Omitted when
    # unset, so older daemons still accept plain registrations.
    adopt_pool: PoolHandle | None = None


class Registered(msgspec.Struct, frozen=True):
    pool: PoolHandle
    daemon_id: str
    peer_address: str
    instance_id: str = ""  # the daemon's incarnation: a restarted daemon has another one
    # The rank's layout as the daemon allocated it: ``auto`` resolved to a concrete
    # kv_layout (the pool's shape follows it). None: a daemon from before "auto".
    layout: LayoutSpec | None = None


class Deregister(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    tp_rank: int
    pp_rank: int = 0


class Ping(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine liveness: a rank not heard from for engine_timeout_s is considered gone."""

    engine_id: str
    tp_rank: int
    pp_rank: int = 0


class Publish(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    engine_id: Id
    request_id: Id
    block_ids: list[int]
    lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_LEASE_S)] | None = None
    consumers: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONSUMERS)] = 1
    # Hybrid engines: one list per KV-cache group; block_ids is then their concatenation.
    group_block_ids: list[list[int]] | None = None
    # The hold's id, chosen by the engine (0: the daemon picks one). An engine that sends
    # its Publish without waiting for the reply (vLLM's connector: nothing in its step
    # waits on the daemon) builds the receipt itself, ``receipt(instance, hold_id)``,
    # from the instance its rank registered with. Engine-chosen ids are random in
    # [ENGINE_HOLD_ID_MIN, 2**62), above any id the daemon counts to.
    hold_id: Annotated[int, msgspec.Meta(ge=0, lt=2**62)] = 0
    # The request's W3C trace context (v3; "" none): the hold's span joins that trace.
    traceparent: Traceparent = ""


ENGINE_HOLD_ID_MIN = 2**40  # Publish.hold_id chosen by an engine: never a daemon-counted one


class Pull(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Read a published request into local blocks.

    ``request_id`` names the pull on this engine (its done_recving event carries
    it); ``remote_request_id`` is the id the producer published under, when it
    differs (vLLM gives prefill and decode requests different ids; two prefill
    engines may publish the same id). Empty means "the same as request_id".

    ``num_tokens`` is the prompt's token count (-1: unknown). With prefill blocks
    larger than decode blocks and a prefix-cache hit, only it tells where the tail
    starts: without it such a pull is refused rather than placed ambiguously.
    """

    engine_id: Id
    request_id: Id
    remote_engine_id: Id
    remote_address: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    remote_request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    num_tokens: Annotated[int, msgspec.Meta(ge=-1)] = -1
    # Hybrid engines: one list per KV-cache group (attention: the request's last logical
    # blocks; Mamba: its state slot); the flat lists are then their concatenations.
    local_group_block_ids: list[list[int]] | None = None
    remote_group_block_ids: list[list[int]] | None = None
    # The producer daemon's ``Published.receipt`` for this request, passed along by the
    # router (vLLM: kv_transfer_params). It proves the publish happened before this Pull
    # was sent, so READs may go out before the Acquire's reply at any size and are never
    # read again for a young hold. Empty: unknown (the held_s rule applies).
    publish_receipt: Annotated[str, msgspec.Meta(max_length=MAX_RECEIPT_CHARS)] = ""
    # Answer this Pull only when it has ended, with its done_recving event (one Events
    # reply; the event is not queued for polls): one round trip for an engine that waits.
    reply_when_done: bool = False
    # The request's W3C trace context (v3; "" none): the pull's spans join that trace.
    traceparent: Traceparent = ""
    # A progressive pull: sent when the decode engine admits the request, before the
    # producer has sealed anything. ``remote_block_ids`` is then empty (the producer's
    # seals name its blocks); ``local_block_ids`` are the blocks of the whole prompt
    # (after the engine's own prefix hit) and ``num_tokens`` is required. The daemon
    # watches the producer (``Watch``) and reads each sealed range as it comes, as
    # ordinary pulls, and reports one done_recving once the last range has landed.
    progressive: bool = False
    # How long a progressive pull waits for the producer's first seal, and then for each
    # next one (0: the daemon's progressive_hold_s).
    hold_timeout_s: TimeoutS = 0.0

    @property
    def producer_request_id(self) -> str:
        return self.remote_request_id or self.request_id


class Seal(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Producer engine: these blocks of a request are final (a progressive publish).

    Each Seal of one ``generation`` repeats and extends the previous one: ``block_ids`` are
    every final block of the request so far, in prompt order, holding ``num_tokens`` final
    tokens (whole blocks, except with ``complete``). ``complete`` (the last Seal): the
    prompt is whole; for a hybrid model it is the first Seal that names the Mamba state
    (``group_block_ids``), and its lists need not extend the earlier ones (a hybrid consumer
    reads every group once complete). A higher ``generation`` unseals every earlier one (the
    engine preempted the request: its blocks were freed or moved); its block lists start
    again. ``abort``: the request is gone; consumers fail. The first Seal opens the hold
    (``lease_s``, ``consumers``, ``hold_id`` as in Publish); the request ends with one
    done_sending, as a published one does.
    """

    engine_id: Id
    request_id: Id
    block_ids: list[int]
    num_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    generation: Annotated[int, msgspec.Meta(ge=0, lt=2**62)] = 0
    complete: bool = False
    abort: bool = False
    group_block_ids: list[list[int]] | None = None
    lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_LEASE_S)] | None = None
    consumers: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONSUMERS)] = 1
    hold_id: Annotated[int, msgspec.Meta(ge=0, lt=2**62)] = 0


class CancelPull(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consumer engine: stop a progressive pull (the request was aborted). Its
    done_recving still comes (not ok), once nothing of it can land any more: only then
    may the engine reuse the blocks. An ordinary pull, or one that ended, is left as is."""

    engine_id: Id
    request_id: Id


class Producer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A producer engine a consumer will pull from, and the peer address of a daemon
    hosting it (what its engines hand out as ``remote_address``)."""

    engine_id: Id
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDRESS_CHARS)]


class WarmUp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consumer engine: greet these producers now, ahead of the first pull (the handshake,
    the host mappings, the pull's prepared assembly), and keep trying, in the
    background, those not reachable or registered yet (up to ``warm_up_timeout_s``).
    Answered at once; nothing is reported: a producer never greeted is greeted by its
    first pull, as without this message. A producer on this very daemon is warmed at
    registration already."""

    engine_id: Id
    producers: Annotated[list[Producer], msgspec.Meta(max_length=MAX_WARM_PRODUCERS)]


class Poll(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Long poll for completion events of an engine; answered as soon as any exist.

    ``ack`` -1 (the default): each event is delivered once, to one poll, and gone (a
    reply the client gave up on loses its events). ``ack`` >= 0: acknowledged delivery;
    the daemon keeps the engine's events until a Poll acknowledges them: it drops those
    with ``seq`` <= ``ack`` and answers with every later one (so a lost, late or
    duplicated reply loses nothing: the client drops the ``seq`` it has seen).
    ``ack_instance`` is the daemon incarnation the ``ack`` counts in; a different one
    (the daemon restarted) acknowledges nothing.
    """

    engine_id: str
    timeout_s: TimeoutS = 1.0  # the daemon answers after at most 60 s (MAX_POLL_WAIT_S)
    max_events: Annotated[int, msgspec.Meta(ge=1, le=MAX_POLL_EVENTS)] = 1024
    ack: Annotated[int, msgspec.Meta(ge=-1)] = -1
    ack_instance: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""


class Event(msgspec.Struct, frozen=True):
    kind: Literal["done_sending", "done_recving"]
    request_id: str
    ok: bool
    invalid_block_ids: list[int] = []
    error: str = ""
    nbytes: int = 0
    duration_s: float = 0.0
    invalid_group_block_ids: list[list[int]] = []  # hybrid pulls: per group, like the pull
    descriptors: int = 0  # done_recving: NIXL descriptors the pull posted (engine stats)
    # Acknowledged polls (Poll.ack >= 0): the event's number in this daemon incarnation,
    # increasing in the order events are queued; 0 in replies to other polls.
    seq: int = 0


class Events(msgspec.Struct, frozen=True):
    events: list[Event]
    instance_id: str = ""  # acknowledged polls: the incarnation the events' seq count in


class StatusQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class RankStatus(msgspec.Struct, frozen=True):
    """One engine rank and its pool (built by the engine registry)."""

    engine_id: str
    rank: str
    tp_size: int
    pp_size: int
    pool: str
    pool_bytes: int
    gone: bool
    pins: int
    page_bytes: int = 0  # page size backing a DRAM pool (4096: the slow 4 KiB fallback)
    backing: str = ""  # kvd.pool.shm.PoolBacking value chosen for it, or "cuda_ipc"


class PeerStatus(msgspec.Struct, frozen=True):
    """A cached handshake: a remote engine as seen through one of its daemons."""

    address: str
    local_engine: str
    remote_engine: str
    agent: str
    instance: str = ""
    path: str = ""  # the path its pulls take: "host" (mapped pools, a copy) or "remote"
    why: str = ""  # why that path (e.g. why not "host")


class HeldStatus(msgspec.Struct, frozen=True):
    """A published request this daemon holds (built by the producer)."""

    engine_id: str
    request_id: str
    state: str
    blocks: int
    lease_remaining_s: float
    consumers_done: int
    consumers: int


class PullStatus(msgspec.Struct, frozen=True):
    """A pull in flight (built by the consumer)."""

    engine_id: str
    request_id: str
    state: str
    age_s: float
    remote_engine_id: str
    nbytes: int
    path: str = "remote"  # "remote": NIXL READs from another daemon; "local": copied here
    error: str = ""  # a finished pull's failure


class RailStatus(msgspec.Struct, frozen=True):
    """One posting worker (kvd.transport.remote.workers): its rail ("" for UCX's choice) and the
    READs (parts of pulls) it posted, and their bytes, since the daemon started."""

    worker: int
    rail: str
    agent: str
    reads: int
    nbytes: int


class Status(msgspec.Struct, frozen=True):
    daemon_id: str
    version: str
    draining: bool
    engines: list[RankStatus]
    peers: list[PeerStatus]
    held: list[HeldStatus]
    pulls: list[PullStatus]
    instance_id: str = ""
    rails: list[RailStatus] = []  # empty with a single agent (one posting worker)
    finished_pulls: list[PullStatus] = []  # the last ones, for a short while


# ---------------------------------------------------------------- peer face


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Consumer daemon -> producer daemon, once per (local engine, remote engine)."""

    daemon_id: str
    remote_engine_id: str
    consumer: EngineDesc
    agent_metadata: bytes
    compat_hash: str


class PoolFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a rank's DRAM pool lives as a file on the producer's host ("" path: none,
    a memfd or VRAM pool), with its device and inode (the file's identity: a consumer
    daemon on the same host maps it only if the path opens that very file)."""

    path: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    dev: int = 0
    ino: int = 0


class HelloReply(msgspec.Struct, frozen=True):
    daemon_id: str
    agent_name: str
    agent_metadata: bytes
    engine: EngineDesc
    engine_daemons: list[str]
    # Same-host pulls (older daemons send neither: their pulls go over the network): the
    # producer daemon's host token (kvd.transport.samehost.discovery.same_host_token) and, per rank
    # of ``engine.ranks`` in that order, its pool file.
    host_token: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    pool_files: Annotated[list[PoolFile], msgspec.Meta(max_length=4096)] = msgspec.field(
        default_factory=list)


class Acquire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Before posting READs: is the request still held, with these blocks? Renews its lease.

    The consumer engine's parallelism tells the producer how many planner reads to
    expect from it, so the producer keeps no per-consumer table between requests.
    """

    request_id: str
    producer_engine_id: str
    consumer_engine_id: str
    block_ids: list[int]
    consumer_tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    consumer_pp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    consumer_layer_partition: list[int] | None = None


class Acquired(msgspec.Struct, frozen=True):
    """The request is held; ``epoch`` lets the consumer detect a stale cached handshake.

    ``held_s``: how long the request had been held (since its publish) when this Acquire
    arrived, on the producer's clock (a duration: no clock is compared across nodes). A
    consumer that posted its READs before this reply came back trusts their bytes only
    if the hold is older than the round trip it saw (the READ cannot predate the
    publish); otherwise it reads again.
    """

    epoch: int
    held_s: float = 0.0
    # The hold's id on this daemon incarnation; a Pull whose publish_receipt names it
    # (``receipt(instance, hold_id)``) read after that publish, whatever held_s says.
    hold_id: int = 0


class Abandon(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The consumer gave up after Acquire and its READs are released: stop holding for it."""

    request_id: str
    producer_engine_id: str
    consumer_engine_id: str


class Watch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Consumer daemon -> producer daemon: what of this request is sealed? (progressive)

    Answered by ``Sealed`` as soon as the producer's seals differ from what the consumer
    saw (``generation``, ``num_tokens``, ``complete``; -1: nothing yet) or the request
    ends, else after ``wait_s``. A request not sealed yet is waited for (its first Seal
    may come later). ``done``: the consumer read every block of ``generation``,
    complete; the producer counts it as one consumer done (if that generation is still
    the current one).
    Every Watch renews the hold's lease.
    """

    request_id: Id
    producer_engine_id: Id
    consumer_engine_id: Id
    generation: Annotated[int, msgspec.Meta(ge=-1)] = -1
    num_tokens: Annotated[int, msgspec.Meta(ge=-1)] = -1
    complete: bool = False  # the consumer saw it complete
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)] = 1.0
    done: bool = False


class Sealed(msgspec.Struct, frozen=True):
    """The reply to a Watch: the request's seals as they are now.

    ``state``: ``waiting`` (nothing sealed yet), ``open``, ``complete`` (every block of
    ``generation`` is final), or ``ended`` (aborted, expired, its engine gone:
    ``error`` says which; consumers fail). ``block_size_tokens`` is the producer engine's.
    ``sealed_s``: seconds since the seal that made ``num_tokens`` final, on the producer's
    clock (a READ of those blocks posted after this reply cannot predate that seal).
    """

    state: Literal["waiting", "open", "complete", "ended"]
    generation: int = -1
    num_tokens: int = 0
    block_ids: list[int] = []
    group_block_ids: list[list[int]] | None = None
    block_size_tokens: int = 0
    error: str = ""


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    producer_engine_id: str
    request_ids: Annotated[list[str], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)]


class HeartbeatAck(msgspec.Struct, frozen=True):
    unknown: list[str]


# ---------------------------------------------------------------- replies


class Ok(msgspec.Struct, frozen=True):
    pass


class Published(msgspec.Struct, frozen=True):
    """A publish is held. ``receipt`` names this hold on this daemon incarnation: the
    decode engine passes it in its Pull (see ``Pull.publish_receipt``)."""

    receipt: str = ""


RANGE_MARK = "~~p"  # joins a request id and one range of it (`range_request_id`)
MAX_PROGRESSIVE_ID_CHARS = MAX_ID_CHARS - 64  # room for the range suffix


def range_request_id(request_id: str, generation: int, start: int, end: int,
                     nonce: str) -> str:
    """The id a progressive pull's read of tokens [start, end) of ``generation`` goes
    under (its Acquire, heartbeats, notices): the producer daemon holds those sealed
    blocks under it for that one reader (``nonce``: the consumer's pull)."""
    return f"{request_id}{RANGE_MARK}{generation}.{start}.{end}.{nonce}"


def parse_range_request_id(rid: str) -> tuple[str, int, int, int] | None:
    """(request id, generation, start, end) of a `range_request_id`, else None."""
    base, mark, rest = rid.rpartition(RANGE_MARK)
    if not mark or not base:
        return None
    parts = rest.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        return None
    return base, int(parts[0]), int(parts[1]), int(parts[2])


def receipt(instance_id: str, hold_id: int) -> str:
    """The opaque publish receipt: a daemon incarnation and one hold of it."""
    return f"{instance_id}/{hold_id}"


class Error(msgspec.Struct, frozen=True):
    code: str
    message: str


class ReadNotice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """'These plan reads of the request are done', sent once a pull's READs from a daemon
    are done and its Acquire answered: a peer request (answered Ok), or, to a daemon that
    refuses it (an earlier v2), a NIXL notification prefixed by NOTICE_MAGIC."""

    request_id: str
    producer_engine_id: str
    consumer_engine_id: str
    reads: int
    nbytes: int = 0  # bytes those reads copied out of this daemon's pools (for metrics)


ENGINE_REQUESTS = (RegisterEngine, Deregister, Ping, Publish, Pull, Poll, StatusQuery, Seal,
                   CancelPull, WarmUp)
PEER_REQUESTS = (Hello, Acquire, Heartbeat, Abandon, ReadNotice, Watch)
REPLIES = (Registered, Events, Status, HelloReply, Acquired, HeartbeatAck, Ok, Published,
           Error, Sealed)
ALL_MESSAGES = ENGINE_REQUESTS + PEER_REQUESTS + REPLIES

# The one decode boundary (kvd.wire.codec holds the rules), bound to this message set.


def _stamp(msg: msgspec.Struct) -> int:
    """The version a message is sent as: the oldest that carries it."""
    return PROTOCOL_VERSION if getattr(msg, "traceparent", "") else MIN_PROTOCOL_VERSION


_codec: Codec[Header, ReadNotice] = Codec(PROTOCOL_VERSION, Header, ALL_MESSAGES, ReadNotice,
                                          NOTICE_MAGIC, MAX_HEADER_BYTES,
                                          MIN_PROTOCOL_VERSION, _stamp)
encode = _codec.encode
decode_header = _codec.decode_header
decode_body = _codec.decode_body
decode = _codec.decode
peek_id = _codec.peek_id
encode_notice = _codec.encode_notice
decode_notice = _codec.decode_notice


def _clean_descriptions(node: Any) -> Any:
    """Every ``description`` as ``inspect.cleandoc`` gives it: msgspec 0.23 puts the
    docstrings in raw (their indentation kept), earlier versions cleaned them, and the
    schema must not depend on which one is installed."""
    if isinstance(node, dict):
        return {k: (inspect.cleandoc(v) if k == "description" and isinstance(v, str)
                    else _clean_descriptions(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def schema() -> dict[str, Any]:
    """JSON Schema of every message, the language-neutral form kept in proto/."""
    _, components = msgspec.json.schema_components(
        (Header, ReadNotice, *ALL_MESSAGES), ref_template="#/$defs/{name}"
    )
    components = _clean_descriptions(components)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvd wire protocol",
        "protocol_version": PROTOCOL_VERSION,
        "min_protocol_version": MIN_PROTOCOL_VERSION,
        "frames": ["Header", "body named by Header.kind"],
        "engine_requests": [c.__name__ for c in ENGINE_REQUESTS],
        "peer_requests": [c.__name__ for c in PEER_REQUESTS],
        "replies": [c.__name__ for c in REPLIES],
        "notification": {"prefix": NOTICE_MAGIC.decode(), "body": "ReadNotice"},
        "$defs": components,
    }

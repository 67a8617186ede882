"""The sans-IO core of both engine clients: messages, replies, handles, the event stash.

``KvdClient`` and ``AsyncKvdClient`` (kvd.client.api, re-exported as kvd.client) differ
only in how they do I/O;
everything they send and how they read an answer is built here, once, so the two
cannot drift apart.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvd.errors import KvdError, error_from_code
from kvd.pool.mapping import MappedPool, map_pool
from kvd.wire import curve as C
from kvd.wire import protocol as P

DEFAULT_ADDRESS = "tcp://127.0.0.1:7100"
CLOSE_DEREGISTER_TIMEOUT_S = 1.0  # close() deregisters each rank, waiting at most this


def default_address() -> str:
    return os.environ.get("KVD_ENGINE_ADDRESS", DEFAULT_ADDRESS)


def default_curve(address: str, env: dict[str, str] | None = None
                  ) -> tuple[C.KeyPair, bytes] | None:
    """(this engine's keypair, the daemon's public key) when the engine face is reached
    off loopback and both ``KVD_CLIENT_CURVE_SECRET_KEY_FILE`` (the engine's keypair) and
    ``KVD_CLIENT_CURVE_SERVER_KEY_FILE`` (the daemon's public key) are set (the daemon
    runs CURVE there with curve_engine_face); None otherwise: loopback and ipc:// stay
    plaintext, as the daemon keeps them."""
    env = dict(os.environ) if env is None else env
    secret = env.get("KVD_CLIENT_CURVE_SECRET_KEY_FILE")
    server = env.get("KVD_CLIENT_CURVE_SERVER_KEY_FILE")
    if not secret or not server or not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (C.load_keypair(secret, "KVD_CLIENT_CURVE_SECRET_KEY_FILE"),
            C.load_public_key(server, "KVD_CLIENT_CURVE_SERVER_KEY_FILE"))


def default_token() -> str:
    path = os.environ.get("KVD_AUTH_TOKEN_FILE", "")
    return open(path).read().strip() if path else ""


@dataclass
class RankHandle:
    """A registered engine rank and its mapped pool."""

    engine_id: str
    tp_rank: int
    pp_rank: int
    pool: MappedPool
    daemon_id: str
    peer_address: str
    instance_id: str = ""  # the daemon incarnation it is registered with
    # The layout the daemon allocated the pool in: what the engine asked for, with
    # kv_layout "auto" resolved (Registered.layout). Views and kernels follow this one.
    layout: P.LayoutSpec | None = None
    # The registration that made it: re-sent, with adopt_pool, after a daemon restart.
    registration: P.RegisterEngine | None = field(default=None, repr=False)

    @property
    def kv_layout(self) -> str:
        """The pool's concrete kv_layout (never "auto" once registered)."""
        return self.layout.kv_layout if self.layout is not None else ""

    @property
    def kv(self) -> Any:
        """numpy view of the whole pool, shaped by the (resolved) layout."""
        return self.pool.array


BlockIds = Sequence[int] | Sequence[Sequence[int]]  # flat, or one list per KV-cache group


def split_block_ids(ids: BlockIds) -> tuple[list[int], list[list[int]] | None]:
    """(flat ids, per-group lists or None): hybrid engines pass vLLM's block_ids, one
    list per group; the flat field then carries their concatenation, so the daemon's
    range checks and the producer's acquire check see every id."""
    items = list(ids)
    if not items or not isinstance(items[0], Sequence):
        return [int(b) for b in items], None
    groups = [[int(b) for b in g] for g in items]
    return [b for g in groups for b in g], groups


class Messages:
    """The sans-IO core: every request both clients send, and what a reply means."""

    @staticmethod
    def warm_up(engine_id: str, producers: Sequence[tuple[str, str]]) -> P.WarmUp:
        return P.WarmUp(engine_id=engine_id, producers=[
            P.Producer(engine_id=e, address=a) for e, a in producers])

    @staticmethod
    def register(engine_id: str, model: P.ModelSpec, layout: P.LayoutSpec, tp_rank: int,
                 tp_size: int, pp_rank: int, pp_size: int,
                 layer_partition: Sequence[int] | None,
                 engine_daemons: Sequence[str], device_index: int = 0) -> P.RegisterEngine:
        return P.RegisterEngine(engine_id=engine_id, model=model, layout=layout,
                                tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                                pp_size=pp_size,
                                layer_partition=list(layer_partition) if layer_partition else None,
                                engine_daemons=list(engine_daemons), device_index=device_index)

    @staticmethod
    def handle(msg: P.RegisterEngine, reply: P.Registered) -> RankHandle:
        # A daemon from before "auto" sends no layout: it used the requested one as is.
        layout = reply.layout if reply.layout is not None else msg.layout
        return RankHandle(engine_id=msg.engine_id, tp_rank=msg.tp_rank, pp_rank=msg.pp_rank,
                          pool=map_pool(reply.pool), daemon_id=reply.daemon_id,
                          peer_address=reply.peer_address, instance_id=reply.instance_id,
                          layout=layout, registration=msg)

    @staticmethod
    def adoption(old: RankHandle) -> P.RegisterEngine:
        """Register ``old``'s rank again, asking the (restarted) daemon to take over the
        pool it still maps instead of allocating a new one."""
        if old.registration is None:
            raise KvdError("this rank handle does not carry its registration")
        return msgspec.structs.replace(old.registration,
                                       adopt_pool=old.pool.adoption_handle())

    @staticmethod
    def adopted(old: RankHandle, reply: P.Registered) -> RankHandle:
        """The handle after adoption: same mapping (the bytes never moved), the new
        incarnation's name for the pool and its instance."""
        if (reply.pool.kind != old.pool.handle.kind or reply.pool.nbytes != old.pool.handle.nbytes
                or reply.pool.shape != old.pool.handle.shape):
            raise KvdError(f"the daemon adopted pool {old.pool.handle.name!r} as a different "
                           f"pool ({reply.pool.nbytes} bytes, shape {reply.pool.shape})")
        old.pool.handle = reply.pool
        return RankHandle(engine_id=old.engine_id, tp_rank=old.tp_rank, pp_rank=old.pp_rank,
                          pool=old.pool, daemon_id=reply.daemon_id,
                          peer_address=reply.peer_address, instance_id=reply.instance_id,
                          layout=reply.layout if reply.layout is not None else old.layout,
                          registration=old.registration)

    @staticmethod
    def deregister(handle: RankHandle) -> P.Deregister:
        return P.Deregister(engine_id=handle.engine_id, tp_rank=handle.tp_rank,
                            pp_rank=handle.pp_rank)

    @staticmethod
    def ping(handle: RankHandle) -> P.Ping:
        return P.Ping(engine_id=handle.engine_id, tp_rank=handle.tp_rank, pp_rank=handle.pp_rank)

    @staticmethod
    def publish(engine_id: str, request_id: str, block_ids: BlockIds,
                lease_s: float | None, consumers: int, hold_id: int = 0,
                traceparent: str = "") -> P.Publish:
        flat, groups = split_block_ids(block_ids)
        return P.Publish(engine_id=engine_id, request_id=request_id, block_ids=flat,
                         lease_s=lease_s, consumers=consumers, group_block_ids=groups,
                         hold_id=hold_id, traceparent=traceparent)

    @staticmethod
    def pull(engine_id: str, request_id: str, remote_engine_id: str, remote_address: str,
             remote_block_ids: BlockIds, local_block_ids: BlockIds,
             remote_request_id: str, num_tokens: int, publish_receipt: str = "",
             reply_when_done: bool = False, traceparent: str = "") -> P.Pull:
        remote, remote_groups = split_block_ids(remote_block_ids)
        local, local_groups = split_block_ids(local_block_ids)
        return P.Pull(engine_id=engine_id, request_id=request_id,
                      remote_engine_id=remote_engine_id, remote_address=remote_address,
                      remote_block_ids=remote, local_block_ids=local,
                      remote_request_id=remote_request_id, num_tokens=num_tokens,
                      local_group_block_ids=local_groups, remote_group_block_ids=remote_groups,
                      publish_receipt=publish_receipt, reply_when_done=reply_when_done,
                      traceparent=traceparent)

    @staticmethod
    def progressive_pull(engine_id: str, request_id: str, remote_engine_id: str,
                         remote_address: str, local_block_ids: BlockIds, num_tokens: int,
                         remote_request_id: str = "", hold_timeout_s: float = 0.0,
                         reply_when_done: bool = False) -> P.Pull:
        local, local_groups = split_block_ids(local_block_ids)
        return P.Pull(engine_id=engine_id, request_id=request_id,
                      remote_engine_id=remote_engine_id, remote_address=remote_address,
                      remote_block_ids=[], local_block_ids=local,
                      remote_request_id=remote_request_id, num_tokens=num_tokens,
                      local_group_block_ids=local_groups, progressive=True,
                      hold_timeout_s=hold_timeout_s, reply_when_done=reply_when_done)

    @staticmethod
    def seal(engine_id: str, request_id: str, block_ids: BlockIds, num_tokens: int,
             generation: int = 0, complete: bool = False, abort: bool = False,
             lease_s: float | None = None, consumers: int = 1, hold_id: int = 0) -> P.Seal:
        flat, groups = split_block_ids(block_ids)
        return P.Seal(engine_id=engine_id, request_id=request_id, block_ids=flat,
                      num_tokens=num_tokens, generation=generation, complete=complete,
                      abort=abort, group_block_ids=groups, lease_s=lease_s,
                      consumers=consumers, hold_id=hold_id)

    @staticmethod
    def pulled(reply: Any) -> P.Event:
        """The done_recving event a Pull with reply_when_done is answered with."""
        events = Messages.check(reply).events
        if len(events) != 1 or events[0].kind != "done_recving":
            raise KvdError(f"a pull answered when done got {events!r}")
        return events[0]

    @staticmethod
    def poll(engine_id: str, timeout_s: float) -> P.Poll:
        return P.Poll(engine_id=engine_id, timeout_s=timeout_s)

    @staticmethod
    def refusal(error: P.Error) -> KvdError:
        """The daemon's Error as its KvdError class (for a reply taken later)."""
        return error_from_code(error.code, error.message)

    @staticmethod
    def check(reply: Any) -> Any:
        """The reply, or the daemon's Error raised as its KvdError class."""
        if isinstance(reply, P.Error):
            raise error_from_code(reply.code, reply.message)
        return reply


class EventStash:
    """Events polled while waiting for another request's, kept for later waits."""

    def __init__(self) -> None:
        self._kept: dict[str, list[P.Event]] = {}

    def add(self, engine_id: str, events: Sequence[P.Event]) -> None:
        self._kept.setdefault(engine_id, []).extend(events)

    def take(self, engine_id: str, request_id: str, kind: str) -> P.Event | None:
        kept = self._kept.get(engine_id, [])
        for ev in kept:
            if ev.request_id == request_id and ev.kind == kind:
                kept.remove(ev)
                return ev
        return None


def engine_hold_id() -> int:
    """A random hold id for ``Publish.hold_id``: an engine that does not wait for the
    Published reply builds its receipt from it (``P.receipt(instance, hold_id)``)."""
    return P.ENGINE_HOLD_ID_MIN + secrets.randbelow(2**62 - P.ENGINE_HOLD_ID_MIN)


class EventCursor:
    """Exactly-once receipt of one engine's events from acknowledged polls (``Poll.ack``).

    The daemon keeps every event until a Poll acknowledges it, and each reply carries
    every event after the poll's ``ack``, in ``seq`` order. So whatever happens to the
    replies (lost, late, duplicated, reordered; several pollers sharing this cursor),
    the events with ``seq`` above the highest one seen are new and the rest are
    duplicates. A reply from another daemon incarnation restarts the count; one from an
    incarnation already left behind is dropped whole. Thread-safe: a step's
    non-blocking check and a fallback thread may both feed it; ``take`` returns the new
    events in the order they were accepted.
    """

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.ack = 0
        self.instance = ""
        self.duplicates = 0  # events dropped as already seen (for tests and logs)
        self.restarts = 0  # times a reply came from a new incarnation after another
        self._left: deque[str] = deque(maxlen=64)  # incarnations left behind
        self._new: deque[P.Event] = deque()
        self._lock = threading.Lock()

    def poll(self, timeout_s: float, max_events: int = 1024) -> P.Poll:
        with self._lock:
            return P.Poll(engine_id=self.engine_id, timeout_s=timeout_s,
                          max_events=max_events, ack=self.ack, ack_instance=self.instance)

    def note_instance(self, instance: str) -> bool:
        """A reply came from daemon incarnation ``instance``; True if it is a new one after
        another (the daemon restarted: what the old one was doing is lost)."""
        with self._lock:
            return self._switch(instance)

    def _switch(self, instance: str) -> bool:
        if not instance or instance == self.instance or instance in self._left:
            return False
        restarted = bool(self.instance)
        if restarted:
            self._left.append(self.instance)
            self.restarts += 1
        self.instance, self.ack = instance, 0
        return restarted

    def accept(self, reply: P.Events) -> int:
        """Keep the reply's new events for ``take``; returns how many were new."""
        with self._lock:
            if reply.instance_id in self._left:
                self.duplicates += len(reply.events)
                return 0
            self._switch(reply.instance_id)
            new = [e for e in reply.events if e.seq > self.ack]
            self.duplicates += len(reply.events) - len(new)
            if new:
                self.ack = max(e.seq for e in new)
                self._new.extend(new)
            return len(new)

    def has_new(self) -> bool:
        """Whether events accepted are waiting for ``take`` (another poller may have
        accepted them: a step that would wait for its own reply need not)."""
        with self._lock:
            return bool(self._new)

    def take(self) -> list[P.Event]:
        with self._lock:
            out = list(self._new)
            self._new.clear()
            return out

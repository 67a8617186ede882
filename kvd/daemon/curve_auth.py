"""CurveZMQ on the daemon's faces: who may connect, refusals, allowlist reloads.

One `CurveGuard` per daemon holds its keypair and the allowlists (peer face; engine
face when it runs CURVE) and answers ZAP, ZeroMQ's authentication protocol, on the
daemon's context: libzmq asks it, once per connection, whether the client's public key
may connect; the answer carries the key as the connection's User-Id, which the face
checks again on every message (a key removed since the handshake is refused at its
next message, and its connection closed).

Refusals are one log line each (at most one per second and reason; the rest counted
in it) and a count in ``kvd_curve_refusals_total{face,reason}``:

* ``unknown_key``: the client's key is not in the allowlist (ZAP said no);
* ``plaintext``: the client does not speak CURVE (ZMTP mechanism mismatch);
* ``handshake``: the CURVE handshake did not complete (a replayed or forged
  handshake, a client that expected another server key);
* ``revoked``: a connection of a key removed from the allowlist, closed by a reload
  or refused at its next message.

The allowlist is reloaded when its files change (checked every
``curve_reload_interval_s``) or on SIGHUP; a reload that fails (a malformed file)
keeps the previous allowlist and logs why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kvd.config import Config
from kvd.errors import ConfigError
from kvd.ops.metrics import Metrics
from kvd.wire import curve as C

log = logging.getLogger("kvd.curve")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
LOG_EVERY_S = 1.0
FACE_DOMAINS = {"peer": "kvd-peer", "engine": "kvd-engine"}


@dataclass
class FaceConnections:
    """A CURVE face's live connections: descriptor -> the key that spoke on it ("" not
    yet known), for closing a revoked key's connections."""

    keys: dict[int, bytes] = field(default_factory=dict)


class CurveGuard:
    def __init__(self, cfg: Config, keys: C.KeyPair, metrics: Metrics,
                 on_revoked: Callable[[frozenset[bytes]], None] | None = None,
                 on_rekey: Callable[[C.KeyPair], None] | None = None) -> None:
        self.cfg = cfg
        self.keys = keys
        self._on_rekey = on_rekey
        self._key_stamp = C.allowlist_stamp(cfg.curve_secret_key_file)
        self.metrics = metrics
        self.sources = {"peer": cfg.curve_allowlist,
                        "engine": cfg.curve_engine_allowlist or cfg.curve_allowlist}
        self.allowed: dict[str, frozenset[bytes]] = {
            face: C.load_allowlist(src, "curve_engine_allowlist" if face == "engine"
                                   and cfg.curve_engine_allowlist else "curve_allowlist")
            for face, src in self.sources.items()}
        self._stamps = {face: C.allowlist_stamp(src) for face, src in self.sources.items()}
        self.faces: dict[str, FaceConnections] = {}
        self._on_revoked = on_revoked
        self._last_log: dict[tuple[str, str], tuple[float, int]] = {}
        self._reload_now = asyncio.Event()
        self._zap: zmq.asyncio.Socket | None = None
        self._count_keys()

    # ------------------------------------------------------------ set-up

    def secure(self, face: str, sock: zmq.Socket) -> None:
        """Make a face's socket a CURVE server checked by this guard (before bind)."""
        C.server_socket(sock, self.keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, FACE_DOMAINS[face].encode())
        self.faces[face] = FaceConnections()

    def bind_zap(self, ctx: zmq.asyncio.Context) -> None:
        """The ZAP handler must be bound before any CURVE face accepts a connection."""
        self._zap = ctx.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)

    def close(self) -> None:
        if self._zap is not None:
            self._zap.close(0)
            self._zap = None

    # ------------------------------------------------------------ refusals

    def refused(self, face: str, reason: str, text: str) -> None:
        """Count one refusal; log it, at most once a second per (face, reason)."""
        self.metrics.curve_refusals.labels(face=face, reason=reason).inc()
        now = time.monotonic()
        last, skipped = self._last_log.get((face, reason), (0.0, 0))
        if now - last < LOG_EVERY_S:
            self._last_log[(face, reason)] = (last, skipped + 1)
            return
        more = f" ({skipped} more refused since the last line)" if skipped else ""
        log.warning("CURVE refused on the %s face (%s): %s%s", face, reason, text, more,
                    extra={"face": face, "reason": reason})
        self._last_log[(face, reason)] = (now, 0)

    # ------------------------------------------------------------ ZAP

    async def serve_zap(self) -> None:
        """Answer libzmq's ZAP requests: 200 for an allowlisted CURVE key, 400 otherwise."""
        assert self._zap is not None
        while True:
            try:
                frames = await self._zap.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            # [routing id, b"", version, request id, domain, address, identity,
            #  mechanism, credentials...]
            if len(frames) < 8:
                continue
            try:
                ok, user = self._zap_verdict(frames)
            except Exception:  # noqa: BLE001 - refuse (fail closed), keep answering
                log.exception("ZAP request failed: refusing that connection")
                ok, user = False, b""
            rid, _, version, request_id = frames[:4]
            reply = [rid, b"", version, request_id, b"200" if ok else b"400",
                     b"OK" if ok else b"key not allowed", user, b""]
            with contextlib.suppress(zmq.ZMQError):
                await self._zap.send_multipart(reply)

    def _zap_verdict(self, frames: list[bytes]) -> tuple[bool, bytes]:
        """(allowed, the User-Id to give the connection) for one ZAP request."""
        _, _, _, _, domain, address, _, mechanism = frames[:8]
        creds = frames[8:]
        face = next((f for f, d in FACE_DOMAINS.items() if d.encode() == domain), "")
        peer = address.decode(errors="replace")
        if face and mechanism == b"CURVE" and creds and len(creds[0]) == 32:
            key = z85.encode(creds[0])
            if key in self.allowed[face]:
                return True, key
            self.refused(face, "unknown_key",
                         f"a connection from {peer} presented public key "
                         f"{C.fingerprint(key)}..., which is not in the allowlist "
                         f"({self.sources[face]})")
        elif face:
            self.refused(face, "unknown_key",
                         f"a {mechanism.decode(errors='replace')} client from {peer}")
        return False, b""

    # ------------------------------------------------------------ per message

    def check_message(self, face: str, user_id: str | None, fd: int) -> bool:
        """Whether a message on a CURVE face comes from a key still allowed; a revoked
        key's connection is closed."""
        key = (user_id or "").encode()
        conns = self.faces[face]
        if key and key in self.allowed[face]:
            if fd >= 0:
                conns.keys[fd] = key
            return True
        self.refused(face, "revoked", f"a message from public key {C.fingerprint(key)}..., "
                     "removed from the allowlist since its connection was made: closing it")
        _shutdown(fd)
        return False

    def on_event(self, face: str, event: int, value: int) -> None:
        """A monitor event of a CURVE face."""
        conns = self.faces.get(face)
        if conns is None:
            return
        if event == zmq.EVENT_ACCEPTED:
            conns.keys[value] = b""
        elif event == zmq.EVENT_DISCONNECTED:
            conns.keys.pop(value, None)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == C.MECHANISM_MISMATCH:
            self.refused(face, "plaintext", "a client without CURVE (plaintext, or an old "
                         "kvd) tried to connect: this face requires CURVE")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # The client went away mid-handshake (a key trial closing, a reset): not a
            # refusal by this side.
            log.debug("a handshake on the %s face ended early (errno %d)", face, value)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.refused(face, "handshake", f"a CURVE handshake failed (ZMQ error "
                         f"0x{value:x}: a replayed or forged handshake, or a client that "
                         "expected another server key)")

    # ------------------------------------------------------------ reloads

    def request_reload(self) -> None:
        """SIGHUP: reload now."""
        self._reload_now.set()

    async def watch_allowlists(self, interval_s: float) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reload_now.wait(), interval_s)
            forced = self._reload_now.is_set()
            self._reload_now.clear()
            for face, src in self.sources.items():
                stamp = C.allowlist_stamp(src)
                if forced or stamp != self._stamps[face]:
                    self._stamps[face] = stamp
                    self.reload(face)
            stamp = C.allowlist_stamp(self.cfg.curve_secret_key_file)
            if forced or stamp != self._key_stamp:
                self._key_stamp = stamp
                self.rekey()

    def rekey(self) -> None:
        """This daemon's keypair file changed: take the new keypair. Connections made
        with the old one stay up (both keypairs live, until they close); new ones,
        both ways, use the new one."""
        try:
            keys = C.load_keypair(self.cfg.curve_secret_key_file)
        except ConfigError as exc:
            log.error("keypair reload failed, keeping public key %s: %s",
                      self.keys.public.decode(), exc)
            return
        if keys.public == self.keys.public:
            return
        old, self.keys = self.keys, keys
        log.warning("keypair rotated: public key %s -> %s (the old one serves connections "
                    "made with it; new connections use the new one)", old.public.decode(),
                    keys.public.decode())
        if self._on_rekey is not None:
            self._on_rekey(keys)

    def reload(self, face: str) -> None:
        src = self.sources[face]
        try:
            new = C.load_allowlist(src)
        except ConfigError as exc:
            log.error("allowlist reload failed, keeping the previous one (%d keys): %s",
                      len(self.allowed[face]), exc)
            return
        old = self.allowed[face]
        removed = old - new
        self.allowed[face] = new
        self._count_keys()
        log.info("allowlist of the %s face reloaded from %s: %d keys (%d added, %d removed)",
                 face, src, len(new), len(new - old), len(removed))
        if not removed:
            return
        conns = self.faces.get(face)
        if conns is not None:
            # Connections of a removed key, and those that have not spoken yet (their key
            # is unknown here: a key still allowed redials at once).
            doomed = [fd for fd, k in conns.keys.items() if not k or k in removed]
            for fd in doomed:
                conns.keys.pop(fd, None)
                _shutdown(fd)
                self.metrics.curve_refusals.labels(face=face, reason="revoked").inc()
            if doomed:
                log.warning("closed %d connection(s) of the %s face after the allowlist "
                            "dropped %d key(s)", len(doomed), face, len(removed))
        if face == "peer" and self._on_revoked is not None:
            self._on_revoked(removed)

    def _count_keys(self) -> None:
        for face, keys in self.allowed.items():
            self.metrics.curve_allowlist_keys.labels(face=face).set(len(keys))


def _shutdown(fd: int) -> None:
    """End one TCP connection libzmq owns: shut it down on a duplicate descriptor (the
    socket stays libzmq's; it reads end of stream and closes its side)."""
    if fd < 0:
        return
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    try:
        if s.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def monitor_events(curve: bool) -> int:
    base = zmq.EVENT_DISCONNECTED
    if curve:
        base |= zmq.EVENT_ACCEPTED | C.HANDSHAKE_EVENTS
    return base


def parse_event(frames: list[bytes]) -> tuple[int, int]:
    ev = parse_monitor_message(frames)
    return int(ev["event"]), int(ev["value"])

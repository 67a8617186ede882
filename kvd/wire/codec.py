"""The framing and decode boundary of kvd's protocol, generic over its message set.

``kvd.wire.protocol`` defines the messages and binds one ``Codec`` to them; this module
knows only the rules: two frames, header first (bounded in size and depth, unknown
header fields ignored), version checked before the body is touched, the body
decoded only as a kind the face accepts, every failure a ``ProtocolError`` with a
``reason`` for the metrics. A daemon checks the token between ``decode_header``
and ``decode_body``, so an unauthenticated sender never gets a body parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from kvd.errors import ProtocolError, VersionError
from kvd.wire.peek import peek_id

# msgspec raises ValueError subclasses (DecodeError, ValidationError, UnicodeDecodeError)
# on bad bytes, and RecursionError on nesting deeper than the interpreter allows.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError)


class HeaderLike(Protocol):
    v: int
    kind: str
    id: int


H = TypeVar("H", bound=msgspec.Struct)
N = TypeVar("N", bound=msgspec.Struct)


class Codec(Generic[H, N]):
    def __init__(self, version: int, header: type[H], messages: tuple[type, ...],
                 notice: type[N], notice_magic: bytes, max_header_bytes: int,
                 min_version: int | None = None,
                 stamp: Callable[[Any], int] | None = None) -> None:
        """``min_version``: the oldest version still accepted (every version since only
        added optional fields); ``stamp``: the version a message is sent as (the oldest
        that carries it, so older peers keep taking what they can read)."""
        self.version = version
        self.min_version = version if min_version is None else min_version
        self._stamp = stamp
        self.max_header_bytes = max_header_bytes
        self.notice_magic = notice_magic
        self._header_type = header
        self._kind = {cls: cls.__name__ for cls in messages}
        self._header_decoder = msgspec.msgpack.Decoder(header)
        self._decoders = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in messages}
        self._notice_decoder = msgspec.msgpack.Decoder(notice)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: msgspec.Struct, msg_id: int = 0, token: str = "",
               instance: str = "") -> list[bytes]:
        """Two frames: header then body."""
        v = self.version if self._stamp is None else self._stamp(msg)
        header = self._header_type(v=v, kind=self._kind[type(msg)], id=msg_id,
                                   token=token, instance=instance)
        return [self._encoder.encode(header), self._encoder.encode(msg)]

    def decode_header(self, frame: bytes) -> H:
        """The header alone, bounded in size and depth; the version is checked here."""
        if len(frame) > self.max_header_bytes:
            raise ProtocolError(f"header of {len(frame)} bytes exceeds "
                                f"{self.max_header_bytes}", reason="limit")
        try:
            header = self._header_decoder.decode(frame)
        except RecursionError:
            raise ProtocolError("header nested too deeply", reason="limit") from None
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"malformed header: {exc}") from None
        if not self.min_version <= header.v <= self.version:
            raise VersionError(f"protocol version {header.v} not supported (this daemon "
                               f"speaks {self.min_version} to {self.version})")
        return header

    def decode_body(self, header: HeaderLike, frame: bytes, allowed: tuple[type, ...]) -> Any:
        """The body named by an already decoded (and, on a daemon, authenticated) header."""
        decoder = self._decoders.get(header.kind)
        if decoder is None or not any(cls.__name__ == header.kind for cls in allowed):
            raise ProtocolError(f"unknown message kind {header.kind[:64]!r}", reason="unknown")
        try:
            return decoder.decode(frame)
        except RecursionError:
            raise ProtocolError(f"{header.kind} nested too deeply", reason="limit") from None
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"malformed {header.kind}: {exc}") from None

    def decode(self, frames: list[bytes], allowed: tuple[type, ...]) -> tuple[H, Any]:
        """Frames -> (header, body), or ProtocolError (``reason``: decode, unknown, version,
        limit). The version check comes before the body is touched."""
        if len(frames) != 2:
            raise ProtocolError(f"expected 2 frames, got {len(frames)}")
        header = self.decode_header(frames[0])
        return header, self.decode_body(header, frames[1], allowed)

    def peek_id(self, frame: bytes) -> int:
        """The request id of a header that does not decode (a token of the wrong type, deep
        nesting, a stray field), so an Error about it reaches the right call; else 0."""
        return peek_id(frame, self.max_header_bytes)

    def encode_notice(self, notice: N) -> bytes:
        return self.notice_magic + self._encoder.encode(notice)

    def decode_notice(self, raw: bytes) -> N:
        if not raw.startswith(self.notice_magic):
            raise ProtocolError("notification without kvd magic")
        try:
            return self._notice_decoder.decode(raw[len(self.notice_magic):])
        except RecursionError:
            raise ProtocolError("notification nested too deeply", reason="limit") from None
        except _DECODE_ERRORS as exc:
            raise ProtocolError(f"malformed notification: {exc}") from None

"""The engine face's direct door: kvd's two frames over a Unix stream socket.

Why: a ZMQ message leaves the sending process only when that process's ZMQ I/O thread
runs, and reaches the receiver's code only after the receiver's I/O thread has run too.
Inside an engine, that I/O thread competes for a CPU with the engine's own computing
threads (in the engine's scheduling group): a decode's pull waited 25 ms for it on a
busy 2-core host (docs/notes/2026-12-07-sched-trace.md). Over a Unix socket the
engine's thread that sends writes into the kernel itself, and the kernel wakes the
daemon's event loop; a reply waits in the engine's socket until the engine reads it.

Where: for a TCP engine face, a name in the abstract namespace (Linux): nothing is left
on disk and the reach is the network namespace's, the same as the loopback address the
engine face listens on (a sidecar's pod). For an ipc:// engine face, a socket file
beside the ipc path (``<path>.direct``): it reaches every process that reaches the ipc
path (a DaemonSet's hostPath directory shared with the engines' pods). The name
follows the engine face's address (`direct_name`), so an engine needs no setting: a
client whose daemon is reached on loopback or ipc:// tries the door, and keeps to ZMQ
where nobody listens there.

Framing: per message ``u32 header bytes, u32 body bytes`` (little-endian), then the
header, then the body: the same two frames as on ZMQ, decoded by the same codec, the
token checked between header and body. Each length is bounded before anything is
buffered (`FrameReader`): a header to ``MAX_HEADER_BYTES``, a body to the face's
``max_message_bytes``.
"""

from __future__ import annotations

import ipaddress
import struct
import sys

from kvd.errors import ProtocolError

FRAME_HEAD = struct.Struct("<II")  # header bytes, body bytes
MAX_PATH_BYTES = 107  # sun_path holds 108 bytes, the last a NUL
DIRECT_SUFFIX = ".direct"  # an ipc:// face's door: its path and this


def direct_name(engine_address: str, *, serving: bool = False) -> str | None:
    """Where the daemon whose engine face is ``engine_address`` has its direct door:
    ``@name`` in the abstract namespace, or a socket file's path; None where it has none.

    A daemon (``serving``) names a TCP face's door after the port it binds, whatever host
    it binds on; a client uses the door only for an address of this host (loopback or
    ipc://): a TCP address of another host must not reach a daemon of this one that
    happens to use the same port."""
    if engine_address.startswith("ipc://"):
        path = engine_address[len("ipc://"):] + DIRECT_SUFFIX
        if path.startswith("@") or len(path.encode()) > MAX_PATH_BYTES:
            return None  # an abstract ipc name, or no room for the suffix: ZMQ only
        return path
    if not engine_address.startswith("tcp://") or not sys.platform.startswith("linux"):
        return None  # abstract names are Linux's
    host, _, port = engine_address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        return None
    if not serving and not is_loopback_host(host):
        return None
    return f"@kvd-engine-tcp-{int(port)}"


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP address (a host name is not resolved)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_abstract(name: str) -> bool:
    return name.startswith("@")


def address_of(name: str) -> str:
    """The sockaddr of a door: an abstract name's leading NUL, or the path."""
    return "\0" + name[1:] if is_abstract(name) else name


def pack(frames: list[bytes]) -> bytes:
    """One message: its length head, then header and body."""
    header, body = frames
    return FRAME_HEAD.pack(len(header), len(body)) + header + body


class FrameReader:
    """Splits a byte stream into (header, body) messages, refusing a length over its
    bound before buffering it. After a ProtocolError the stream is out of step: the
    caller closes the connection."""

    def __init__(self, max_header_bytes: int, max_body_bytes: int) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        out = []
        buf = self._buf
        at = 0
        head = FRAME_HEAD.size
        while len(buf) - at >= head:
            header_n, body_n = FRAME_HEAD.unpack_from(buf, at)
            if header_n > self.max_header_bytes:
                raise ProtocolError(f"header of {header_n} bytes exceeds "
                                    f"{self.max_header_bytes}", reason="limit")
            if body_n > self.max_body_bytes:
                raise ProtocolError(f"message of {body_n} bytes exceeds "
                                    f"{self.max_body_bytes}", reason="limit")
            end = at + head + header_n + body_n
            if len(buf) < end:
                break
            start = at + head
            out.append((bytes(buf[start:start + header_n]),
                        bytes(buf[start + header_n:end])))
            at = end
        if at:
            del buf[:at]
        return out

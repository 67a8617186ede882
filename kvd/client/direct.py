"""An engine client's direct channel to its daemon: a non-blocking Unix stream socket in
the abstract namespace (kvd.wire.stream says why). Never waits: a write the kernel does
not take whole keeps its tail here and sends it on the next call; a read takes what has
come. Used by ``NoWaitClient`` (kvd.client.nowait), one thread at a time.
"""

from __future__ import annotations

import contextlib
import errno
import socket

from kvd.errors import ProtocolError
from kvd.wire import protocol as P
from kvd.wire import stream as S

MAX_UNSENT_BYTES = 8 * 1024 * 1024  # past it, a send is refused (the daemon is not reading:
# frozen or gone), as ZMQ refuses past its 1,000-message high-water mark
MAX_REPLY_BYTES = 256 * 1024 * 1024  # a reply's body (a Status of a big node stays far below)
READ_CHUNK_BYTES = 256 * 1024


class DirectChannel:
    """One connection to the daemon's direct door; ``broken`` after any failure (the
    owner then goes back to ZMQ and may open a new channel later)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.broken = False
        self._unsent = bytearray()
        self._reader = S.FrameReader(P.MAX_HEADER_BYTES, MAX_REPLY_BYTES)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setblocking(False)

    @classmethod
    def connect(cls, name: str) -> DirectChannel | None:
        """A connected channel, or None where nobody listens (no such name, refused):
        a Unix connect is answered at once."""
        ch = cls(name)
        try:
            ch.sock.connect(S.address_of(name))
        except (ConnectionRefusedError, FileNotFoundError, BlockingIOError, OSError):
            ch.close()
            return None
        return ch

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frames: list[bytes], write: bool = True) -> bool:
        """Queue one message without waiting: written now as far as the kernel takes it
        (``write=False``: kept until the next ``flush``, to leave with the ones after it).
        False if the channel is broken or too much is still unsent."""
        if self.broken or len(self._unsent) > MAX_UNSENT_BYTES:
            return False
        self._unsent += S.pack(frames)
        if write:
            self.flush()
        return not self.broken

    def flush(self) -> None:
        """Write what is unsent, as far as the kernel takes it now."""
        while self._unsent and not self.broken:
            try:
                n = self.sock.send(self._unsent, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.broken = True
                return
            del self._unsent[:n]

    def receive(self) -> list[tuple[bytes, bytes]]:
        """Every whole message that has come; never waits."""
        out: list[tuple[bytes, bytes]] = []
        while not self.broken:
            try:
                data = self.sock.recv(READ_CHUNK_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self.broken = True
                break
            if not data:  # the daemon closed it (stopped, restarted, refused a message)
                self.broken = True
                break
            try:
                out.extend(self._reader.feed(data))
            except ProtocolError:
                self.broken = True
        self.flush()
        return out

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.close()

"""CurveZMQ keys for kvd's control plane: key files, the allowlist, socket set-up.

A daemon (or an engine) has one long-term keypair, written by ``kvd keys`` in ZeroMQ's
certificate format (``NAME.key``: the public key; ``NAME.key_secret``: both keys, mode
0600). An allowlist is a directory of public key files (a mounted Kubernetes Secret or
ConfigMap: every regular file not starting with ``.``) or one file; a file holds either
certificate lines (``public-key = "..."``) or bare Z85 keys, one per line, ``#``
comments allowed. Secret keys found in an allowlist are ignored, never read into it.

The secret key never appears in a repr, a log line or an error message.

A client must know the server's public key before it connects (CurveZMQ encrypts the
first message to it). kvd daemons learn each other's address from pulls, not keys:
`discover_server_key` tries the allowlisted keys against the address at once, one
connection each, and keeps the one whose handshake completes (one round trip, at the
first contact only: the caller caches it). Only a daemon holding the secret of an
allowlisted key can complete it, so this is also the client's check of the server.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvd.errors import AuthError, ConfigError

Z85_KEY_CHARS = 40
MAX_ALLOWLIST_KEYS = 4096
MAX_KEY_FILE_BYTES = 1 << 20
ZAP_DOMAIN = "kvd"
_Z85 = r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}"
_CERT_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"(' + _Z85 + r')"\s*$')
_BARE = re.compile(r"^\s*(" + _Z85 + r")\s*$")
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes = field(repr=False)

    def __repr__(self) -> str:  # never the secret, whatever prints this
        return f"KeyPair(public={self.public.decode()!r})"

    __str__ = __repr__


def _fingerprint(key: bytes) -> str:
    """A short, loggable name of a public key (its first 8 Z85 characters)."""
    return key[:8].decode(errors="replace")


def fingerprint(key: bytes) -> str:
    return _fingerprint(key)


def _parse(text: str, path: str) -> tuple[list[bytes], list[bytes]]:
    """(public keys, secret keys) found in one key file's text."""
    public, secret = [], []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        m = _CERT_LINE.match(line)
        if m:
            (public if m.group(1) == "public" else secret).append(m.group(2).encode())
            continue
        m = _BARE.match(line)
        if m:
            public.append(m.group(1).encode())
    return public, secret


def _read(path: Path) -> str:
    size = path.stat().st_size
    if size > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{path}: {size} bytes is too large for a key file")
    return path.read_text(errors="replace")


def write_keypair(directory: str | Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Create ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) in ``directory``.

    The secret file is created with mode 0600 from the start (never briefly readable) and
    never overwritten unless ``force``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
        raise ConfigError(f"key name {name!r}: use letters, digits, '.', '_', '-'")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = d / f"{name}.key", d / f"{name}.key_secret"
    head = "#   kvd CURVE certificate (ZeroMQ format), written by `kvd keys`\n"
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    for path, body, mode in (
        (sec_path, f'{head}#   SECRET: keep it mode 0600, never share it\nmetadata\ncurve\n'
                   f'    public-key = "{public.decode()}"\n'
                   f'    secret-key = "{secret.decode()}"\n', 0o600),
        (pub_path, f'{head}metadata\ncurve\n    public-key = "{public.decode()}"\n', 0o644),
    ):
        try:
            fd = os.open(path, flags, mode)
        except FileExistsError:
            raise ConfigError(f"{path} exists: pass --force to replace it") from None
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)
            f.write(body)
    return pub_path, sec_path


def load_keypair(path: str | Path, setting: str = "curve_secret_key_file") -> KeyPair:
    """The keypair in a ``.key_secret`` file; refused when any user may read it (mode
    bits for "others"). Group read is accepted: a Kubernetes Secret volume read by a
    non-root container is owned by root and its fsGroup (mode 0440)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ConfigError(f"{setting}: {str(path)!r}: {exc.strerror}") from None
    if st.st_mode & 0o007:
        raise ConfigError(f"{setting}: {str(path)!r} is open to other users (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 it (or 0440 with a "
                          "group of its own)")
    public, secret = _parse(_read(p), str(path))
    if len(public) != 1 or len(secret) != 1:
        raise ConfigError(f"{setting}: {str(path)!r} is not a kvd keypair file (want one "
                          "public-key and one secret-key line, as `kvd keys` writes)")
    try:
        derived = zmq.curve_public(secret[0])
    except zmq.ZMQError:
        derived = b""
    if derived != public[0]:
        raise ConfigError(f"{setting}: {str(path)!r}: its public key does not match its "
                          "secret key")
    return KeyPair(public[0], secret[0])


def load_public_key(path: str | Path, setting: str) -> bytes:
    """The one public key of a file (``NAME.key``, or a keypair file)."""
    public, _ = _parse(_read(Path(path)), str(path))
    if len(public) != 1:
        raise ConfigError(f"{setting}: {str(path)!r} holds {len(public)} public keys, want 1")
    return public[0]


def allowlist_files(source: str | Path) -> list[Path]:
    p = Path(source)
    if p.is_dir():
        return sorted(f for f in p.iterdir()
                      if not f.name.startswith(".") and f.is_file())
    return [p]


def load_allowlist(source: str | Path, setting: str = "curve_allowlist") -> frozenset[bytes]:
    """Every public key of a directory or a file (secret keys skipped), at most
    MAX_ALLOWLIST_KEYS."""
    if not Path(source).exists():
        raise ConfigError(f"{setting}: {str(source)!r} does not exist")
    keys: set[bytes] = set()
    for f in allowlist_files(source):
        try:
            public, _ = _parse(_read(f), str(f))
        except OSError as exc:
            raise ConfigError(f"{setting}: {f}: {exc.strerror}") from None
        keys.update(public)
    if len(keys) > MAX_ALLOWLIST_KEYS:
        raise ConfigError(f"{setting}: {len(keys)} keys, at most {MAX_ALLOWLIST_KEYS}")
    return frozenset(keys)


def allowlist_stamp(source: str | Path) -> tuple[tuple[str, int, int, int], ...]:
    """What changes when the allowlist's files do (names, inodes, sizes, mtimes): cheap
    to take every second. A Kubernetes volume update swaps a symlink: stat follows it."""
    out = []
    try:
        for f in allowlist_files(source):
            try:
                st = f.stat()
            except OSError:
                continue
            out.append((f.name, st.st_ino, st.st_size, st.st_mtime_ns))
    except OSError:
        return ()
    return tuple(out)


def server_socket(sock: zmq.Socket, keys: KeyPair) -> None:
    """Make a bound (server) socket CURVE: set before bind. Clients are checked by the
    ZAP handler of the socket's context, in domain ZAP_DOMAIN."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def client_socket(sock: zmq.Socket, keys: KeyPair, server_key: bytes) -> None:
    """Make a connecting socket CURVE, checking the server's key: set before connect."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def handshake_refusal(address: str, event: int, value: int, curve: bool) -> AuthError:
    """The error a client reports when ZMQ's handshake with ``address`` failed."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == MECHANISM_MISMATCH:
        if curve:
            why = ("it does not speak CURVE (a plaintext daemon): this daemon refuses "
                   "plaintext peers")
        else:
            why = ("it requires CURVE (curve_secret_key_file set there) and this side "
                   "is plaintext: give this side a keypair (kvd keys) and allowlist it there")
    elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = "it does not allow this side's public key (not in its allowlist)"
    elif not curve:
        why = ("the ZMTP handshake failed: it most likely requires CURVE (curve_secret_key_"
               "file set there) and this side is plaintext")
    else:
        why = ("the CURVE handshake failed: it does not speak CURVE (a plaintext daemon, "
               "refused here), or it does not hold the key expected")
    why += f" [zmq event 0x{event:x}, 0x{value:x}]"
    return AuthError(f"{address} refused the connection: {why}")


async def discover_server_key(ctx: zmq.asyncio.Context, address: str, keys: KeyPair,
                              candidates: list[bytes], timeout_s: float) -> bytes | None:
    """The allowlisted key ``address`` holds the secret of: every candidate tried at once
    (one DEALER each, nothing sent but the handshake), the first to complete wins.

    None when every handshake failed for want of the right key (the server refused none
    of them by name); AuthError when the server does not speak CURVE or refused our key;
    KvdTimeoutError when none finished within ``timeout_s``."""
    from kvd.errors import KvdTimeoutError

    if not candidates:
        return None
    if len(candidates) == 1:  # nothing to choose: the connection itself checks it
        return candidates[0]
    socks: list[tuple[bytes, zmq.asyncio.Socket, zmq.asyncio.Socket]] = []
    try:
        for key in candidates:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, -1)  # one try per key
            client_socket(s, keys, key)
            mon = s.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED
                                       | zmq.EVENT_CLOSED)
            s.connect(address)
            socks.append((key, s, mon))
        pending = {asyncio.ensure_future(_outcome(k, m)): k for k, _, m in socks}
        failures: list[tuple[int, int]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while pending:
            done, _ = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for t in done:
                pending.pop(t)
                ok, event, value, key = t.result()
                if ok:
                    for other in pending:
                        other.cancel()
                    return key
                failures.append((event, value))
        for t in pending:
            t.cancel()
        if failures and not pending:
            named = [f for f in failures if f == (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                                  MECHANISM_MISMATCH)
                     or f[0] == zmq.EVENT_HANDSHAKE_FAILED_AUTH]
            if named:
                raise handshake_refusal(address, *named[0], curve=True)
            return None
        raise KvdTimeoutError(f"{address}: no CURVE handshake completed within {timeout_s}s "
                              f"({len(candidates)} allowlisted keys tried)")
    finally:
        for _, s, mon in socks:
            try:
                s.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(0)
            s.close(0)


async def _outcome(key: bytes, mon: zmq.asyncio.Socket) -> tuple[bool, int, int, bytes]:
    """(handshake succeeded, event, value, key) of one trial connection."""
    while True:
        ev = parse_monitor_message(await mon.recv_multipart())
        e, v = int(ev["event"]), int(ev["value"])
        if e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True, e, v, key
        if e & (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
            return False, e, v, key
        if e in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            # Closed before any handshake verdict: the server dropped us (a wrong server
            # key: it cannot read our HELLO and says nothing).
            return False, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, key

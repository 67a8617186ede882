"""Is a peer daemon on this host, can its DRAM pools be mapped here, is an address us?

Three questions a daemon asks before choosing a local copy over a network READ:

* **Same host?** Not by IP address: pods on one node have different IPs, and one IP
  may be NATed to many hosts. The kernel's boot id (``/proc/sys/kernel/random/boot_id``,
  random per boot, the same in every container of that kernel) says "same kernel".
  A daemon advertises a `HostFacts` as a host token (`same_host_token`): the boot id,
  the machine id (informational: containers of one host may have different ones), the
  inode of its IPC namespace, and its pool directory's path, device and inode.
* **Can its pools be mapped here?** (`dram_reachable`) Same kernel and either the
  peer's pool directory, looked up here by its path, is the same directory (same
  device and inode: a shared hostPath or the same /dev/shm), or both run in one IPC
  namespace (hostIPC pods, or plain processes of one host). Anything else: the
  network, with the reason said.
* **Does an endpoint name this daemon?** (`names_this_daemon`) An engine names its
  producer's daemon by the address it was given; the same daemon is spelled
  ``tcp://127.0.0.1:P``, ``tcp://localhost:P``, ``tcp://<advertised ip>:P``,
  ``tcp://0.0.0.0:P`` or ``tcp://[::1]:P``, ``ipc://rel/path`` or via a symlink.

The deciding functions are pure (facts in, answer out); `host_facts` and
`local_host_names` are the thin edges that read the system.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

TOKEN_VERSION = "kvdhost1"
MAX_TOKEN_CHARS = 4096
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                            "ip6-loopback"})


@dataclass(frozen=True)
class HostFacts:
    """What identifies this kernel, IPC namespace and pool directory ("" / 0: unknown)."""

    boot_id: str = ""
    machine_id: str = ""
    ipc_ns: int = 0  # inode of /proc/self/ns/ipc
    pool_dir: str = ""
    pool_dir_dev: int = 0
    pool_dir_ino: int = 0

    @property
    def pool_dir_id(self) -> tuple[int, int] | None:
        return (self.pool_dir_dev, self.pool_dir_ino) if self.pool_dir_ino else None


@dataclass(frozen=True)
class Reach:
    """``ok``: the peer's DRAM pools can be mapped here; ``how``: ``shared_pool_dir`` or
    ``same_ipc_namespace`` (or "" when not); ``reason``: one line for `kvd status`."""

    ok: bool
    how: str
    reason: str


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()[:200]
    except OSError:
        return ""


def host_facts(pool_dir: str, proc: str = "/proc", etc: str = "/etc") -> HostFacts:
    """This process's facts (reads /proc and /etc; anything unreadable stays unknown)."""
    boot_id = _read(Path(proc, "sys/kernel/random/boot_id"))
    machine_id = _read(Path(etc, "machine-id")) or _read(Path("/var/lib/dbus/machine-id"))
    try:
        ipc_ns = os.stat(Path(proc, "self/ns/ipc")).st_ino
    except OSError:
        ipc_ns = 0
    dev = ino = 0
    path = os.path.realpath(pool_dir) if pool_dir else ""
    if path:
        try:
            st = os.stat(path)
            dev, ino = st.st_dev, st.st_ino
        except OSError:
            pass
    return HostFacts(boot_id=boot_id, machine_id=machine_id, ipc_ns=ipc_ns, pool_dir=path,
                     pool_dir_dev=dev, pool_dir_ino=ino)


def same_host_token(facts: HostFacts) -> str:
    """The facts as one printable string, for the handshake (parse: `parse_host_token`)."""
    fields = (facts.boot_id, facts.machine_id, str(facts.ipc_ns), facts.pool_dir,
              str(facts.pool_dir_dev), str(facts.pool_dir_ino))
    token = ";".join([TOKEN_VERSION] + [quote(f, safe="") for f in fields])
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"host token of {len(token)} characters (at most {MAX_TOKEN_CHARS})")
    return token


def parse_host_token(token: str) -> HostFacts:
    """A peer's token back as facts; ValueError for anything not made by
    `same_host_token` of this version (a token from a newer kvd: no local path)."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise ValueError("host token: not a string of at most "
                         f"{MAX_TOKEN_CHARS} characters")
    parts = token.split(";")
    if parts[0] != TOKEN_VERSION or len(parts) != 7:
        raise ValueError(f"host token: expected {TOKEN_VERSION} with 6 fields, got "
                         f"{parts[0][:20]!r} with {len(parts) - 1}")
    boot_id, machine_id, ipc_ns, pool_dir, dev, ino = (unquote(p) for p in parts[1:])
    try:
        numbers = [int(x) for x in (ipc_ns, dev, ino)]
    except ValueError:
        raise ValueError("host token: ipc namespace, device and inode must be integers") \
            from None
    if any(n < 0 for n in numbers):
        raise ValueError("host token: negative ipc namespace, device or inode")
    return HostFacts(boot_id=boot_id, machine_id=machine_id, ipc_ns=numbers[0],
                     pool_dir=pool_dir, pool_dir_dev=numbers[1], pool_dir_ino=numbers[2])


def dram_reachable(mine: HostFacts, peer: HostFacts,
                   peer_dir_here: tuple[int, int] | None) -> Reach:
    """Whether ``peer``'s DRAM pools can be mapped by this process (pure).

    ``peer_dir_here``: (device, inode) of the peer's ``pool_dir`` path as seen from here
    (`stat_dir`), None when it does not exist here.
    """
    if not mine.boot_id or not peer.boot_id:
        return Reach(False, "", "host unknown: no boot id on "
                     + ("this side" if not mine.boot_id else "the peer's side"))
    if mine.boot_id != peer.boot_id:
        return Reach(False, "", "another host (kernel boot id differs)")
    if peer.pool_dir_id is not None and peer_dir_here == peer.pool_dir_id:
        return Reach(True, "shared_pool_dir",
                     f"same host, pool directory {peer.pool_dir} shared")
    if mine.ipc_ns and mine.ipc_ns == peer.ipc_ns:
        return Reach(True, "same_ipc_namespace", "same host and IPC namespace")
    here = ("missing here" if peer_dir_here is None
            else f"another directory here ({peer_dir_here[0]}:{peer_dir_here[1]})")
    return Reach(False, "", f"same host, but another IPC namespace and the peer's pool "
                 f"directory {peer.pool_dir or '(none)'} is {here}: mount it shared "
                 "(hostPath) or serve both engines from one daemon")


def stat_dir(path: str) -> tuple[int, int] | None:
    """(device, inode) of a directory as seen from here, None if there is none."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) else None


# --------------------------------------------------------------- addresses


def _norm_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.split("%", 1)[0]  # IPv6 zone id
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_endpoint(address: str) -> tuple[str, str, int | None]:
    """("tcp", normalised host, port) or ("ipc", path, None); ValueError otherwise."""
    scheme, sep, rest = address.strip().partition("://")
    scheme = scheme.lower()
    if not sep or not rest:
        raise ValueError(f"not an endpoint: {address!r}")
    if scheme == "ipc":
        return "ipc", rest, None
    if scheme != "tcp":
        raise ValueError(f"endpoint {address!r}: only tcp:// and ipc:// are understood")
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or not tail.startswith(":"):
            raise ValueError(f"endpoint {address!r}: expected tcp://[v6]:port")
        port_s = tail[1:]
    else:
        host, colon, port_s = rest.rpartition(":")
        if not colon:
            raise ValueError(f"endpoint {address!r}: no port")
        if ";" in host:  # zmq's "tcp://source;dest:port": the destination counts
            host = host.rsplit(";", 1)[1]
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"endpoint {address!r}: port {port_s!r} is not a number") from None
    if not 0 < port < 65536 or not host:
        raise ValueError(f"endpoint {address!r}: no host or port out of range")
    return "tcp", _norm_host(host), port


def _host_names_us(host: str, own_host: str, local: frozenset[str]) -> bool:
    """Does a connection to ``host`` reach a socket bound (or advertised) at ``own_host``?"""
    if host == own_host:
        return True
    if own_host in WILDCARD_HOSTS:
        # Bound on every address: any address or name of this host reaches it, and so
        # does a connect to the wildcard itself (Linux routes it to this host).
        return host in WILDCARD_HOSTS or _is_loopback(host) or host in local
    if _is_loopback(own_host):
        # "localhost" resolves to 127.0.0.1 and ::1, a connect to the wildcard goes to
        # the loopback of its family; 127.0.0.2 does not reach a bind on 127.0.0.1.
        if own_host == "127.0.0.1":
            return host in LOOPBACK_NAMES or host in ("0.0.0.0", "*")
        if own_host == "::1":
            return host in LOOPBACK_NAMES or host == "::"
        return False
    # A specific address of this host: reached by a name of this host only when the
    # caller says that name is this host's (names resolve outside a pure function);
    # another address, even of this host, does not reach a socket bound on this one.
    return own_host in local and host in local and not _is_ip(host)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def names_this_daemon(address: str, own_addresses: Iterable[str],
                      local_hosts: Iterable[str] = (), cwd: str | None = None,
                      realpath: Callable[[str], str] = os.path.realpath) -> bool:
    """Whether ``address`` names one of this daemon's endpoints (``own_addresses``: the
    bound and the advertised ones), however it is spelled.

    tcp: the same port and a host that reaches the bound address: the same address;
    for a wildcard bind (``*``, ``0.0.0.0``, ``::``) any loopback address or name, the
    wildcard itself, or one of ``local_hosts`` (this host's names and addresses,
    `local_host_names`); for a loopback bind ``localhost``. An advertised address matches
    as written (normalised: case, brackets, IPv4-mapped IPv6). ipc: the same socket
    path once made absolute (relative to ``cwd``, default the current directory) and
    its symlinks resolved by ``realpath``. Unparseable addresses name nothing.
    """
    try:
        kind, host, port = split_endpoint(address)
    except ValueError:
        return False
    local = frozenset(_norm_host(h) for h in local_hosts)
    base = cwd if cwd is not None else os.getcwd()
    for own in own_addresses:
        try:
            own_kind, own_host, own_port = split_endpoint(own)
        except ValueError:
            continue
        if own_kind != kind:
            continue
        if kind == "ipc":
            if host.startswith("@") or own_host.startswith("@"):  # abstract namespace
                if host == own_host:
                    return True
                continue
            a = realpath(os.path.normpath(os.path.join(base, host)))
            b = realpath(os.path.normpath(os.path.join(base, own_host)))
            if a == b:
                return True
        elif port == own_port and _host_names_us(host, own_host, local):
            return True
    return False


def local_host_names() -> frozenset[str]:
    """This host's name, FQDN and the addresses they resolve to (reads the resolver;
    for `names_this_daemon`'s ``local_hosts``)."""
    names = set()
    for name in (socket.gethostname(), socket.getfqdn()):
        if not name:
            continue
        names.add(name)
        try:
            for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP):
                names.add(str(info[4][0]))
        except OSError:
            pass
    return frozenset(_norm_host(n) for n in names)

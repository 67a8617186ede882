"""Tear down this process's TCP connections to one host: how a READ is made unable to land.

Why (NIXL PR #2047): releasing a running NIXL request does not stop UCX (its
``ucp_request_cancel`` is a no-op for RMA), and NIXL 1.5 closes UCP endpoints without
``UCP_EP_CLOSE_FLAG_FORCE`` (flush mode: the close itself waits for the READ). Over
UCX's TCP transport a READ's bytes reach our memory only through ``recv`` on one of
the worker's sockets to the peer. ``shutdown(SHUT_RDWR)`` on those sockets (on a
duplicate descriptor: the socket is shared, UCX keeps its descriptor) makes the next
receive end of stream; UCX then fails the endpoint, completes its requests with an
error and closes the sockets, and from that moment nothing can land. kvd still waits
for the transport to report the READ ended before it hands anything back.

Only sockets kvd does not own are touched: the caller names the local ports of its
own listeners (engine, peer, metrics) and the remote port of the peer's control
channel (ZMQ). RDMA transports have no socket to shut: there 0 comes back, and the
caller keeps the READ's blocks quarantined.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterable

log = logging.getLogger("kvd.transport")

_LISTEN = "0A"
_NETLINK_SOCK_DIAG = 4
_SOCK_DESTROY = 21
_NLM_F_REQUEST_ACK = 0x1 | 0x4
_NLMSG_ERROR = 2
_ALL_STATES = 0xFFFFFFFF
_NOCOOKIE = 0xFFFFFFFF


def _addr(hex_addr: str) -> tuple[str, int]:
    """A /proc/net/tcp{,6} address ("0100007F:1F90") as (ip text, port)."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


Ends = tuple[int, tuple[str, int], tuple[str, int]]  # (family, local, remote)


def _connections(proc: str) -> dict[int, Ends]:
    """Inode -> (family, local, remote) of every non-listening TCP socket here."""
    out: dict[int, Ends] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] == _LISTEN:
                continue
            family = socket.AF_INET if table == "tcp" else socket.AF_INET6
            out[int(cols[9])] = (family, _addr(cols[1]), _addr(cols[2]))
    return out


def _ips(hosts: Iterable[str]) -> set[str]:
    ips = set()
    for h in hosts:
        try:
            ips.add(str(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:  # a host name: every address it resolves to
            try:
                ips.update(str(a[4][0]) for a in socket.getaddrinfo(h, None))
            except OSError:
                continue
    return ips


def connections_to(hosts: Iterable[str], spare_local_ports: Iterable[int] = (),
                   spare_remote_ports: Iterable[int] = (),
                   proc: str = "/proc/self") -> list[tuple[int, int, Ends]]:
    """(descriptor, inode, ends) of this process's TCP connections to ``hosts``, but those
    from one of ``spare_local_ports`` or to one of ``spare_remote_ports``."""
    ips = _ips(hosts)
    spare_l, spare_r = set(spare_local_ports), set(spare_remote_ports)
    conns = _connections(proc)
    found = []
    for name in os.listdir(f"{proc}/fd"):
        try:
            target = os.readlink(f"{proc}/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        inode = int(target[8:-1])
        ends = conns.get(inode)
        if ends is None:
            continue
        _, (_, lport), (rip, rport) = ends
        if rip in ips and lport not in spare_l and rport not in spare_r:
            found.append((int(name), inode, ends))
    return found


def _packed(family: int, ip: str) -> bytes:
    raw = ipaddress.ip_address(ip).packed
    if family == socket.AF_INET6 and len(raw) == 4:
        raw = b"\0" * 10 + b"\xff\xff" + raw  # an IPv4-mapped address of a dual socket
    return raw.ljust(16, b"\0")


def destroy(ends: Ends) -> bool:
    """Abort one TCP connection in the kernel (``SOCK_DESTROY``, what ``ss -K`` does):
    its queues are dropped, the peer gets a reset (its side fails instead of closing
    gracefully and reconnecting), and the owner's next call on it errors. Needs
    CAP_NET_ADMIN and CONFIG_INET_DIAG_DESTROY; False when refused."""
    family, (lip, lport), (rip, rport) = ends
    sockid = struct.pack("!HH16s16s", lport, rport, _packed(family, lip), _packed(family, rip))
    sockid += struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE)
    req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, _ALL_STATES) + sockid
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DESTROY, _NLM_F_REQUEST_ACK, 1, 0) + req
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(msg)
            reply = nl.recv(4096)
    except OSError as exc:
        log.debug("SOCK_DESTROY: %s", exc)
        return False
    if len(reply) >= 20 and struct.unpack_from("=H", reply, 4)[0] == _NLMSG_ERROR:
        err = struct.unpack_from("=i", reply, 16)[0]
        if err:
            log.debug("SOCK_DESTROY refused: %s", os.strerror(-err))
        return err == 0
    return False


def shut_connections_to(hosts: Iterable[str], spare_local_ports: Iterable[int] = (),
                        spare_remote_ports: Iterable[int] = ()) -> int:
    """End every connection `connections_to` finds; how many were.

    Each is aborted in the kernel (`destroy`: a reset, which the peer's UCX treats as a
    failed endpoint) where kvd may; otherwise it is shut down both ways on a duplicate
    descriptor (a FIN: UCX may then redial, see docs/reliability.md)."""
    shut = 0
    for fd, inode, ends in connections_to(hosts, spare_local_ports, spare_remote_ports):
        if destroy(ends):
            shut += 1
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:  # closed and reused meanwhile: not ours
                continue
            sock = socket.socket(fileno=dup)
            dup = -1  # the socket object owns it now
            try:
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError as exc:  # already closed by the peer: nothing to stop
                log.debug("shutdown of fd %d: %s", fd, exc)
            finally:
                sock.close()  # the duplicate only
        finally:
            if dup >= 0:
                os.close(dup)
    return shut

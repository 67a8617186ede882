"""Tear down this process's TCP connections to one host: how a READ is made unable to land.

Why (issue 21, NIXL PR #2047): releasing a running NIXL request does not stop UCX (its
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
from collections.abc import Iterable

log = logging.getLogger("kvd.transport")

_LISTEN = "0A"


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


def _connections(proc: str) -> dict[int, tuple[tuple[str, int], tuple[str, int]]]:
    """Inode -> (local, remote) of every non-listening TCP socket in our namespace."""
    out: dict[int, tuple[tuple[str, int], tuple[str, int]]] = {}
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
            out[int(cols[9])] = (_addr(cols[1]), _addr(cols[2]))
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
                   proc: str = "/proc/self") -> list[tuple[int, int]]:
    """(descriptor, inode) of this process's TCP connections to ``hosts``, but those from
    one of ``spare_local_ports`` or to one of ``spare_remote_ports``."""
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
        (_, lport), (rip, rport) = ends
        if rip in ips and lport not in spare_l and rport not in spare_r:
            found.append((int(name), inode))
    return found


def shut_connections_to(hosts: Iterable[str], spare_local_ports: Iterable[int] = (),
                        spare_remote_ports: Iterable[int] = ()) -> int:
    """Shut down (both ways) every connection `connections_to` finds; how many were."""
    shut = 0
    for fd, inode in connections_to(hosts, spare_local_ports, spare_remote_ports):
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

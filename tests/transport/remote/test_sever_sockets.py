"""kvd.transport.remote.sockets: which connections a sever tears down, and how."""

from __future__ import annotations

import socket

import pytest

from kvd.transport.remote import sockets


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2])
    served, _ = listener.accept()
    return client, served


def test_only_the_peer_connections_not_spared_are_torn_down() -> None:
    with socket.create_server(("127.0.0.1", 0)) as data, \
            socket.create_server(("127.0.0.1", 0)) as control:
        ours, theirs = _pair(data)  # a transport connection to the peer
        ctl, ctl_served = _pair(control)  # the daemon's own control connection
        try:
            spare_local = [data.getsockname()[1], control.getsockname()[1]]
            found = {ends[1][1] for _, _, ends in sockets.connections_to(
                ["127.0.0.1"], spare_local_ports=spare_local,
                spare_remote_ports=[control.getsockname()[1]])}
            # Both ends of the data connection live in this process; the spared listener
            # port hides the served end, the spared remote port the control connection.
            assert found == {ours.getsockname()[1]}
            assert sockets.shut_connections_to(
                ["127.0.0.1"], spare_local, [control.getsockname()[1]]) == 1
            theirs.settimeout(2.0)
            try:
                assert theirs.recv(10) == b""  # FIN (shutdown, no CAP_NET_ADMIN)
            except ConnectionResetError:
                pass  # reset (SOCK_DESTROY)
            ctl.sendall(b"alive")  # untouched
            assert ctl_served.recv(10) == b"alive"
        finally:
            for s in (ours, theirs, ctl, ctl_served):
                s.close()


def test_destroy_resets_the_peer_where_the_kernel_allows() -> None:
    with socket.create_server(("127.0.0.1", 0)) as data:
        ours, theirs = _pair(data)
        try:
            [(_, _, ends)] = [c for c in sockets.connections_to(["127.0.0.1"])
                              if c[2][1][1] == ours.getsockname()[1]]
            if not sockets.destroy(ends):
                pytest.skip("SOCK_DESTROY refused here (no CAP_NET_ADMIN or "
                            "CONFIG_INET_DIAG_DESTROY)")
            theirs.settimeout(2.0)
            with pytest.raises(ConnectionResetError):
                theirs.recv(10)
            with pytest.raises(OSError):
                ours.recv(10)  # ECONNABORTED: its owner's next call fails
        finally:
            ours.close()
            theirs.close()


def test_host_names_resolve_and_unknown_hosts_match_nothing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as data:
        ours, theirs = _pair(data)
        try:
            port = ours.getsockname()[1]
            assert port in {e[1][1] for _, _, e in sockets.connections_to(["localhost"])}
            assert sockets.connections_to(["no-such-host.invalid"]) == []
        finally:
            ours.close()
            theirs.close()

"""DaemonProcess.start must not leave a daemon behind when it gives up waiting."""

from __future__ import annotations

import pytest

from kvd.errors import KvdError
from kvd.tools.localcluster import DaemonProcess


def test_start_kills_a_daemon_that_is_not_ready_in_time(tmp_path, monkeypatch):
    spawned: list[DaemonProcess] = []
    spawn = DaemonProcess._spawn.__func__

    def spy(cls, *args, **kwargs):
        d = spawn(cls, *args, **kwargs)
        spawned.append(d)
        return d

    monkeypatch.setattr(DaemonProcess, "_spawn", classmethod(spy))
    with pytest.raises(KvdError, match="not ready"):
        DaemonProcess.start("slow", tmp_path, timeout_s=0.05)  # Python alone needs longer
    assert spawned
    for d in spawned:
        assert d.proc.poll() is not None, "a daemon the caller cannot stop was left running"


def test_picked_ports_are_distinct() -> None:
    """CI once gave a daemon one port for both faces (two picks in a row returned the
    same free port): it could not bind its peer face and the test's fixture errored."""
    from kvd.tools.localcluster import free_ports

    for _ in range(20):
        ports = free_ports(3)
        assert len(set(ports)) == 3, ports


def test_a_face_whose_port_was_taken_meanwhile_is_started_again(tmp_path, monkeypatch):
    """kvd's own line for a face it could not bind ("address already in use (another
    kvd? ...)") counts as a lost race, as ZMQ's "Address already in use" did: the start
    is tried again on new ports."""
    import socket

    from kvd.tools import localcluster

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    real = localcluster.free_ports
    picks = []

    def first_peer_port_taken(n: int) -> list[int]:
        ports = real(n)
        if not picks:
            ports[1] = taken.getsockname()[1]  # the peer face's: another process has it
        picks.append(ports)
        return ports

    monkeypatch.setattr(localcluster, "free_ports", first_peer_port_taken)
    try:
        d = DaemonProcess.start("raced", tmp_path)
        try:
            assert len(picks) == 2
            assert d.peer_address != f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        finally:
            assert d.stop() == 0
    finally:
        taken.close()

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

"""The daemon's CPU priority (``cpu_nice``): every thread of ``kvd serve`` runs at it, a
raise that is not allowed leaves the daemon as started with a warning, and 0 changes
nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvd.daemon.priority import apply_nice, log_priority
from kvd.tools.localcluster import DaemonProcess


def _nice_of_threads(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return out


def test_every_thread_of_a_served_daemon_runs_at_its_cpu_nice(tmp_path: Path) -> None:
    """The lowest priority is always allowed, so this holds for any user: the daemon's
    threads (the ZMQ I/O threads, the copy threads, the HTTP server's, NIXL's) made
    after start-up run at the configured nice too."""
    d = DaemonProcess.start("nice", tmp_path, ["--set", "cpu_nice=19"], timeout_s=60)
    try:
        threads = _nice_of_threads(d.proc.pid)
        assert len(threads) > 1  # the setting is per thread on Linux: all, not one
        assert set(threads.values()) == {19}, threads
        assert "CPU priority: nice 19" in d.log_path.read_text()
    finally:
        d.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs CAP_SYS_NICE")
def test_by_default_the_daemon_runs_ahead_of_the_engines(tmp_path: Path) -> None:
    d = DaemonProcess.start("nice-default", tmp_path, timeout_s=60)
    try:
        assert set(_nice_of_threads(d.proc.pid).values()) == {-10}
    finally:
        d.kill()


class _Fake:
    def __init__(self, threads: list[int], allowed: bool) -> None:
        self.nice = dict.fromkeys(threads, 0)
        self.allowed = allowed
        self.calls: list[tuple[int, int]] = []

    def get(self, which: int, who: int) -> int:
        return self.nice[who or min(self.nice)]

    def set(self, which: int, who: int, value: int) -> None:
        self.calls.append((who, value))
        # the first thread is let through, so that the undo is tested too
        if value < self.nice[who] and not self.allowed and who != min(self.nice):
            raise PermissionError(13, "Permission denied")
        self.nice[who] = value


def test_a_raise_that_is_refused_leaves_every_thread_as_it_was(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = _Fake([100, 101, 102], allowed=False)
    with caplog.at_level(logging.WARNING, logger="kvd.daemon"):
        got = apply_nice(-10, getpriority=fake.get, setpriority=fake.set,
                         threads=lambda: sorted(fake.nice))
        assert caplog.text == ""  # said once the daemon serves, not before
        log_priority(got)
    assert got.nice == 0 and got.refused == "Permission denied"
    assert fake.nice == {100: 0, 101: 0, 102: 0}  # the one set before the refusal undone
    assert "kvd runs at nice 0, not cpu_nice=-10" in caplog.text
    assert "CAP_SYS_NICE" in caplog.text


def test_a_thread_that_ended_meanwhile_does_not_stop_the_others() -> None:
    fake = _Fake([100, 101, 102], allowed=True)

    def set_(which: int, who: int, value: int) -> None:
        if who == 101:
            raise ProcessLookupError(3, "No such process")
        fake.set(which, who, value)

    got = apply_nice(-5, getpriority=fake.get, setpriority=set_,
                     threads=lambda: sorted(fake.nice))
    assert got.nice == -5 and not got.refused
    assert fake.nice == {100: -5, 101: 0, 102: -5}


def test_zero_leaves_the_process_as_started() -> None:
    fake = _Fake([100, 101], allowed=True)
    fake.nice = {100: 3, 101: 3}
    got = apply_nice(0, getpriority=fake.get, setpriority=fake.set,
                     threads=lambda: sorted(fake.nice))
    assert got.nice == 3 and fake.calls == []

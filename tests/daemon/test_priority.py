"""The daemon's CPU priority (``cpu_nice``): every thread of ``kvd serve`` runs at it, a
raise that is not allowed leaves the daemon as started with a warning, and 0 changes
nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvd.daemon.priority import (
    AUTOGROUP_SELF,
    AUTOGROUP_SWITCH,
    Priority,
    apply_group_nice,
    apply_nice,
    log_priority,
)
from kvd.tools.localcluster import DaemonProcess


def _nice_of_threads(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return out


def _no_group(wanted: int) -> str:
    return ""


def _autogroup_nice(pid: int) -> int | None:
    """The nice of the process's session autogroup; None where the kernel has none."""
    switch = Path(AUTOGROUP_SWITCH)
    if not switch.exists() or switch.read_text().strip() != "1":
        return None
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


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
        # started in a session of its own (as the local cluster and the bench start it):
        # its autogroup, where the kernel groups by session, is set too
        group = _autogroup_nice(d.proc.pid)
        assert group in (None, 19)
        if group is not None:
            assert "its session's autogroup at nice 19" in d.log_path.read_text()
    finally:
        d.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs CAP_SYS_NICE")
def test_by_default_the_daemon_runs_ahead_of_the_engines(tmp_path: Path) -> None:
    d = DaemonProcess.start("nice-default", tmp_path, timeout_s=60)
    try:
        assert set(_nice_of_threads(d.proc.pid).values()) == {-10}
        # a thread's nice weighs only within its group: against engines in sessions of
        # their own, it is the session's autogroup that counts
        assert _autogroup_nice(d.proc.pid) in (None, -10)
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
                         threads=lambda: sorted(fake.nice), group_nice=_no_group)
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
                     threads=lambda: sorted(fake.nice), group_nice=_no_group)
    assert got.nice == -5 and not got.refused
    assert fake.nice == {100: -5, 101: 0, 102: -5}


def test_zero_leaves_the_process_as_started() -> None:
    fake = _Fake([100, 101], allowed=True)
    fake.nice = {100: 3, 101: 3}
    got = apply_nice(0, getpriority=fake.get, setpriority=fake.set,
                     threads=lambda: sorted(fake.nice), group_nice=_no_group)
    assert got.nice == 3 and fake.calls == []


class _Proc:
    """/proc as apply_group_nice sees it."""

    def __init__(self, enabled: str | None, group: str | None, allowed: bool = True) -> None:
        self.files = {AUTOGROUP_SWITCH: enabled, AUTOGROUP_SELF: group}
        self.allowed = allowed
        self.written: list[str] = []

    def read(self, path: str) -> str | None:
        return self.files[path]

    def write(self, path: str, text: str) -> None:
        assert path == AUTOGROUP_SELF
        if not self.allowed:
            raise PermissionError(1, "Operation not permitted")
        self.written.append(text)


def test_a_session_leader_sets_its_autogroup() -> None:
    proc = _Proc("1\n", "/autogroup-7 nice 0\n")
    got = apply_group_nice(-10, read=proc.read, write=proc.write, leads_session=lambda: True)
    assert proc.written == ["-10"]
    assert got == "its session's autogroup at nice -10"


def test_a_daemon_sharing_its_session_leaves_the_group_alone() -> None:
    """Raising a shell's autogroup would raise every process of that session."""
    proc = _Proc("1\n", "/autogroup-7 nice 0\n")
    got = apply_group_nice(-10, read=proc.read, write=proc.write, leads_session=lambda: False)
    assert proc.written == []
    assert "left as it is" in got and "setsid" in got


def test_no_autogroups_no_change() -> None:
    for enabled, group in (("0\n", "/autogroup-7 nice 0\n"), (None, None), ("1\n", None)):
        proc = _Proc(enabled, group)
        assert apply_group_nice(-10, read=proc.read, write=proc.write,
                                leads_session=lambda: True) == ""
        assert proc.written == []
    proc = _Proc("1\n", "/autogroup-7 nice 0\n")
    assert apply_group_nice(0, read=proc.read, write=proc.write,
                            leads_session=lambda: True) == ""
    assert proc.written == []


def test_a_refused_group_raise_is_said_and_the_threads_keep_theirs(
        caplog: pytest.LogCaptureFixture) -> None:
    proc = _Proc("1\n", "/autogroup-7 nice 0\n", allowed=False)
    fake = _Fake([100, 101], allowed=True)
    got = apply_nice(-10, getpriority=fake.get, setpriority=fake.set,
                     threads=lambda: sorted(fake.nice),
                     group_nice=lambda w: apply_group_nice(w, read=proc.read,
                                                           write=proc.write,
                                                           leads_session=lambda: True))
    assert got.nice == -10 and fake.nice == {100: -10, 101: -10}
    assert "stays as it was (Operation not permitted)" in got.group
    with caplog.at_level(logging.INFO, logger="kvd.daemon"):
        log_priority(got)
    assert "CPU priority: nice -10; its session's autogroup stays as it was" in caplog.text


def test_threads_already_at_the_value_still_get_their_group() -> None:
    fake = _Fake([100], allowed=True)
    fake.nice = {100: -10}
    seen: list[int] = []
    got = apply_nice(-10, getpriority=fake.get, setpriority=fake.set,
                     threads=lambda: sorted(fake.nice),
                     group_nice=lambda w: seen.append(w) or "set")
    assert fake.calls == [] and seen == [-10] and got == Priority(-10, -10, group="set")

"""``kvd bench vllm``'s turns: the systems not measured are paused (SIGSTOP) as a whole,
the measured one continued, daemons before engines; the host's load of each turn is
recorded; a system that fails is dropped and the run goes on.

Real child processes stand in for the engines and daemons (no vLLM). That a daemon and
its engines paused together keep their registrations and leases is
``tests/daemon/engines/test_stall_processes.py`` (both frozen together retire nobody).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from kvd.errors import KvdError
from kvd.tools.bench import vllm_turns
from kvd.tools.bench.vllm_launch import Running
from kvd.tools.bench.vllm_run import BenchConfig, VllmBench
from kvd.tools.bench.vllm_systems import system_spec
from kvd.tools.bench.vllm_turns import Group, Hogs, Turns, is_stopped, session_pids


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            start_new_session=True)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        p = _sleeper()
        started.append(p)
        return p

    yield start
    for p in started:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait(10)


def _wait_state(pid: int, stopped: bool) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if is_stopped(pid) == stopped:
            return True
        time.sleep(0.01)
    return False


def test_a_turn_pauses_the_other_systems_and_continues_its_own(procs):
    a_daemon, a_engine, b_daemon, b_engine = procs(), procs(), procs(), procs()
    turns = Turns({"a": Group((a_daemon.pid,), (a_engine.pid,)),
                   "b": Group((b_daemon.pid,), (b_engine.pid,))}, settle_s=0.0)
    with turns.turn("a"):
        assert all(_wait_state(p.pid, True) for p in (b_daemon, b_engine))
        assert not is_stopped(a_daemon.pid) and not is_stopped(a_engine.pid)
    with turns.turn("b"):
        assert all(_wait_state(p.pid, True) for p in (a_daemon, a_engine))
        assert all(_wait_state(p.pid, False) for p in (b_daemon, b_engine))
    turns.resume_all()
    assert all(_wait_state(p.pid, False) for p in (a_daemon, a_engine, b_daemon, b_engine))
    load = turns.summary()
    assert set(load) == {"a", "b"} and load["a"]["turns"] == 1
    assert {"runnable_p50", "host_cores", "system_cores", "others_cores"} <= set(load["a"])


def test_daemons_continue_before_engines_and_stop_after_them(monkeypatch):
    sent: list[tuple[tuple[int, ...], int]] = []
    monkeypatch.setattr(vllm_turns, "signal_sessions",
                        lambda sids, sig: sent.append((tuple(sids), sig)))
    slept: list[float] = []
    turns = Turns({"a": Group((1,), (2, 3)), "b": Group((4,), (5,))}, settle_s=0.5,
                  sleep=slept.append)
    with turns.turn("a"):
        pass
    assert sent == [((5,), signal.SIGSTOP), ((4,), signal.SIGSTOP)]  # b: engines first
    sent.clear()
    with turns.turn("b"):
        pass
    assert sent == [((2, 3), signal.SIGSTOP), ((1,), signal.SIGSTOP),
                    ((4,), signal.SIGCONT), ((5,), signal.SIGCONT)]
    assert slept == [0.5]  # a system continued settles before its turn


def test_hogs_busy_a_core_each_and_stop():
    hogs = Hogs(1)
    try:
        pid = hogs.pids()[0]
        t0 = vllm_turns.cpu_s([pid])
        # busy: it keeps taking CPU (on a starved host it may wait for it a while; an
        # idle process would take none however long we wait)
        deadline = time.monotonic() + 30.0
        while vllm_turns.cpu_s([pid]) - t0 <= 0.2:
            assert time.monotonic() < deadline, "the hog took no CPU in 30 s"
            time.sleep(0.1)
    finally:
        hogs.stop()
    assert not session_pids(pid)


def _bench(tmp_path, names: list[str]) -> VllmBench:
    bench = VllmBench(BenchConfig(systems=tuple(names), rounds=2), tmp_path, tmp_path,
                      log=lambda msg: None)
    for n in names:
        bench.systems[n] = Running(system_spec(n), {})
    return bench


def test_a_system_that_fails_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    bench = _bench(tmp_path, ["plain", "kvd-1d", "nixl-noprog"])
    done: list[tuple[str, int]] = []

    def single(name: str, rnd: int, seed: int) -> None:
        if name == "nixl-noprog":  # its warm-up request gave no token
            raise KvdError("stream :1234 gave no tokens")
        done.append((name, rnd))

    monkeypatch.setattr(bench, "_single", single)
    for rnd in range(2):
        bench.single_round(rnd, bench._live(["plain", "kvd-1d", "nixl-noprog"]))
    assert done == [("plain", 0), ("kvd-1d", 0), ("plain", 1), ("kvd-1d", 1)]
    assert "gave no tokens" in bench.failed_systems["nixl-noprog"]

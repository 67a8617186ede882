"""The connector's warning for CPU engines whose workers vLLM pinned to the same cores
(kvd.integrations.connector_core.cpu_binding).

The real-process cases build what vLLM builds: an "engine core" process whose child
carries vLLM's worker title and pins itself, one such pair per engine, and read them
back through /proc as the connector does.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.integrations.connector_core import cpu_binding as cb
from kvd.integrations.connector_core.cpu_binding import Worker, parse_cpu_list, pinned_neighbours

ALL = frozenset({0, 1, 2, 3})


def w(pid: int, parent: int, cpus: set[int], parent_cpus: frozenset[int] = ALL) -> Worker:
    return Worker(pid, parent, frozenset(cpus), parent_cpus)


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


def test_two_engines_pinned_to_shared_cores_are_found() -> None:
    own = w(10, 1, {0})
    assert pinned_neighbours(own, [own, w(20, 2, {0, 1})]) == [w(20, 2, {0, 1})]


@pytest.mark.parametrize("other", [
    w(20, 2, {1}),               # its own cores: the fix
    w(20, 2, set(ALL)),          # not pinned (nobind): the kernel moves it
    w(11, 1, {0}),               # a worker of the same engine (its engine core's business)
])
def test_no_warning_for_disjoint_unpinned_or_same_engine_workers(other: Worker) -> None:
    assert pinned_neighbours(w(10, 1, {0}), [other]) == []


def test_an_unpinned_worker_warns_about_nobody() -> None:
    assert pinned_neighbours(w(10, 1, set(ALL)), [w(20, 2, {0})]) == []


def test_a_cpuset_is_not_a_binding() -> None:
    """A container limits the engine core too: a worker on all of its parent's cores is
    not pinned, however few they are."""
    small = frozenset({0})
    assert pinned_neighbours(w(10, 1, {0}, small), [w(20, 2, {0}, small)]) == []


ENGINE = """
import os, subprocess, sys
worker = '''
import os, sys, time
with open("/proc/self/comm", "w") as f:
    f.write("VLLM::Worker")
if sys.argv[1] != "all":
    os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
print("ready", flush=True)
time.sleep(60)
'''
p = subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], stdout=sys.stdout)
p.wait()
"""


@pytest.fixture
def engines() -> Iterator[object]:
    """``start(cpus)``: a fake engine (engine core + titled worker); returns the worker
    pid once it has pinned itself. Every one is killed at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(cpus: str) -> int:
        core = subprocess.Popen([sys.executable, "-c", ENGINE, cpus], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        started.append(core)
        assert core.stdout is not None
        assert core.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while True:
            kids = Path(f"/proc/{core.pid}/task/{core.pid}/children").read_text().split()
            if kids:
                return int(kids[0])
            assert time.monotonic() < deadline, "the fake worker did not start"
            time.sleep(0.01)

    yield start
    for core in started:
        os.killpg(core.pid, 9)
        core.wait()


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="needs two CPUs to pin apart")


@needs_two_cpus
def test_real_workers_pinned_to_one_core_warn(engines: object,
                                              caplog: pytest.LogCaptureFixture) -> None:
    first = engines("0")  # type: ignore[operator]
    second = engines("0")  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="kvd.vllm"):
        msg = cb.warn_if_shared(second)
    assert msg is not None and f"pid {first}: CPUs 0" in msg, msg
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in msg
    assert [r.getMessage() for r in caplog.records] == [msg]


@needs_two_cpus
@pytest.mark.parametrize("first_cpus, second_cpus", [("0", "1"), ("all", "all"), ("0", "all")])
def test_real_workers_on_their_own_cores_or_unpinned_are_quiet(
        engines: object, first_cpus: str, second_cpus: str) -> None:
    """Quiet about each other. On a host shared with other test runs, a real vLLM worker
    of theirs pinned to the same core is rightly named: only this pair is judged."""
    first = engines(first_cpus)  # type: ignore[operator]
    second = engines(second_cpus)  # type: ignore[operator]
    msg = cb.warn_if_shared(second)
    assert msg is None or f"pid {first}:" not in msg, msg


def test_a_process_that_is_not_a_worker_is_checked_as_one() -> None:
    """Scheduler-level tests build workers in the test process (no vLLM title): the scan
    still reads its own mask."""
    own, _ = cb.scan(os.getpid())
    assert own is not None and own.pid == os.getpid()
    assert own.cpus == frozenset(os.sched_getaffinity(0))

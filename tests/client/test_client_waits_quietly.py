"""A call waiting on a daemon that does not answer sleeps in one kernel poll, and close()
still ends it at once.

Inside a vLLM worker the connector's event poller waits in ``KvdClient.call`` while a
daemon is frozen. It used to wake every 100 ms to look at a stop flag; each wake takes
the GIL, and on a busy host the engine's step then waited up to a switch interval
(5 ms) for it (tests/integrations/vllm/test_scheduler_hook_latency.py, "slept 5.6 ms").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq

from kvd.client import KvdClient
from kvd.errors import KvdError, KvdTimeoutError
from kvd.wire import protocol as P


@pytest.fixture
def silent_daemon():
    """A daemon face that takes requests and never answers."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    router.close(0)
    ctx.term()


def _wakes(native_id: int) -> int:
    """Times the thread went to sleep and was woken (voluntary context switches)."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("voluntary_ctxt_switches")))


def test_a_call_to_a_silent_daemon_sleeps_until_its_deadline(silent_daemon):
    client = KvdClient(silent_daemon, timeout_s=1.5, ping_interval_s=0)
    ready = threading.Event()
    outcome: list[BaseException] = []
    ids: list[int] = []

    def call() -> None:
        ids.append(threading.get_native_id())
        ready.set()
        try:
            client.call(P.StatusQuery())
        except KvdError as exc:
            outcome.append(exc)

    t = threading.Thread(target=call)
    t.start()
    ready.wait()
    time.sleep(0.3)  # the call is waiting now
    before = _wakes(ids[0])
    time.sleep(1.0)
    during = _wakes(ids[0]) - before
    t.join(5)
    client.close()
    assert isinstance(outcome[0], KvdTimeoutError)
    # One poll until the deadline: no wake in a second of waiting (it woke ~10 times
    # when it looked at its stop flag every 100 ms). A stray wake is allowed.
    assert during <= 2, f"the waiting thread woke {during} times in 1 s"


def test_close_ends_a_call_in_flight_at_once(silent_daemon):
    client = KvdClient(silent_daemon, timeout_s=30.0, ping_interval_s=0)
    outcome: list[BaseException] = []
    ended: list[float] = []

    def call() -> None:
        try:
            client.call(P.StatusQuery())
        except KvdError as exc:
            outcome.append(exc)
        ended.append(time.monotonic())

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)
    closed_s = time.monotonic()
    client.close()
    t.join(5)
    assert not t.is_alive()
    assert "client closed" in str(outcome[0])
    assert ended[0] - closed_s < 0.5

"""vLLM's shared-memory queue reader (how the engine core of a multiprocess executor
takes its workers' answers, and each worker its steps) waits in the kernel while kvd's
quiet window is open, and past its spin cap, and still wakes the moment the answer is
written; with neither it spins as vLLM does.

Real vLLM ``MessageQueue`` (writer and reader in one process, the reader on a thread,
whose CPU time is its own); no engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from vllm.distributed.device_communicators.shm_broadcast import (  # noqa: E402
    MessageQueue,
    SpinCondition,
)

from kvd.integrations.vllm import executor_wait  # noqa: E402

pytestmark = pytest.mark.vllm

PARK_S = 0.4  # the worker's park: the answer is written this long after the read starts


@pytest.fixture
def queue() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join()
    writer.enqueue("warm")  # a read just happened: vLLM's reader is in its busy second
    assert reader.dequeue(timeout=5) == "warm"
    yield writer, reader
    executor_wait.quiet_for(0.0)
    executor_wait.cap_spin(None)
    reader.shutdown()
    writer.shutdown()


def _read_while_parked(writer: MessageQueue, reader: MessageQueue
                       ) -> tuple[float, float, float]:
    """The reader waits for an answer written PARK_S later: (its CPU s, the wall s it
    waited, how late after the write it woke)."""
    out: dict[str, float] = {}

    def read() -> None:
        cpu0, t0 = time.thread_time(), time.monotonic()
        assert reader.dequeue(timeout=10) == "answer"
        out.update(cpu_s=time.thread_time() - cpu0, wall_s=time.monotonic() - t0,
                   woke_s=time.monotonic())

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(PARK_S)
    written_s = time.monotonic()
    writer.enqueue("answer")
    thread.join(timeout=10)
    return out["cpu_s"], out["wall_s"], out["woke_s"] - written_s


def test_a_quiet_window_waits_in_the_kernel_and_wakes_at_the_answer(queue) -> None:
    writer, reader = queue
    assert executor_wait.install()
    assert executor_wait.install()  # once: a second install is a no-op
    assert getattr(SpinCondition.wait, "_kvd_quiet", False)
    executor_wait.quiet_for(PARK_S)
    cpu_s, wall_s, late_s = _read_while_parked(writer, reader)
    assert wall_s >= PARK_S * 0.9
    print(f"\nquiet window: {cpu_s:.3f} CPU s waiting {wall_s:.3f} s, woke "
          f"{late_s * 1000:.1f} ms after the answer")
    assert cpu_s < 0.1 * wall_s, f"{cpu_s:.3f} CPU s in {wall_s:.3f} s: it spun"
    assert late_s < 0.05, f"woke {late_s * 1000:.0f} ms after the answer"


def test_outside_a_window_the_reader_spins_as_vllm_does(queue) -> None:
    """The contrast (vLLM's busy second after a read): what a parked worker cost the
    engine core before."""
    writer, reader = queue
    executor_wait.install()
    executor_wait.quiet_for(0.0)
    executor_wait.cap_spin(None)
    cpu_s, wall_s, late_s = _read_while_parked(writer, reader)
    print(f"\nno window: {cpu_s:.3f} CPU s waiting {wall_s:.3f} s")
    assert cpu_s > 0.3 * wall_s, f"{cpu_s:.3f} CPU s in {wall_s:.3f} s"
    assert late_s < 0.05


def test_past_the_window_vllm_spins_again() -> None:
    now = [100.0]
    executor_wait.quiet_for(0.05, now=lambda: now[0])
    try:
        assert executor_wait.quiet_left_s(lambda: now[0]) == pytest.approx(
            0.05 + executor_wait.MARGIN_S)
        now[0] += 0.05 + executor_wait.MARGIN_S
        assert executor_wait.quiet_left_s(lambda: now[0]) == 0.0
    finally:
        executor_wait.quiet_for(0.0)


def test_past_its_spin_cap_a_reader_sleeps_until_the_write(queue) -> None:
    """A worker between two requests (vLLM's busy second after its last step): with
    the connector's cap it spins 5 ms, then waits in the kernel, and still wakes at the
    write. Without the cap it took a core for the whole wait (the test above): on a
    shared CPU host that core was the other engine's."""
    writer, reader = queue
    assert executor_wait.install()
    executor_wait.cap_spin(0.005)
    cpu_s, wall_s, late_s = _read_while_parked(writer, reader)
    print(f"\ncap 5 ms: {cpu_s:.3f} CPU s waiting {wall_s:.3f} s, woke "
          f"{late_s * 1000:.1f} ms after the write")
    assert wall_s >= PARK_S * 0.9
    assert cpu_s < 0.1 * wall_s, f"{cpu_s:.3f} CPU s in {wall_s:.3f} s: it spun"
    assert late_s < 0.05, f"woke {late_s * 1000:.0f} ms after the write"


def test_a_wait_is_timed_from_its_own_start_not_the_last_read() -> None:
    """vLLM times its busy loop from the last read; the cap counts from the start of
    each wait (the calls between two reads), so a worker whose step took longer than
    the cap still spins the cap's length for its next step."""
    calls: list[float] = []

    class Reader:
        is_reader = True
        busy_loop_s = 1.0
        last_read = 0.0

    def orig(self: Reader, timeout_ms: int | None = None) -> None:
        calls.append(self.busy_loop_s)

    now = [10.0]
    wait = executor_wait.wrap_wait(orig, now=lambda: now[0])
    r = Reader()
    executor_wait.cap_spin(0.005)
    try:
        r.last_read = 9.9  # read 100 ms ago (a long step), then the wait starts
        wait(r)
        now[0] += 0.004
        wait(r)
        now[0] += 0.002
        wait(r)  # 6 ms into this wait: past the cap
        r.last_read = now[0]  # a read: the next wait is a new one
        now[0] += 0.010
        wait(r)
        assert calls == [1.0, 1.0, -1.0, 1.0]  # spin, spin, sleep, spin
        assert r.busy_loop_s == 1.0  # vLLM's own value is left as it was
        executor_wait.cap_spin(None)
        now[0] += 5.0
        wait(r)
        assert calls[-1] == 1.0  # no cap: vLLM's own loop decides
    finally:
        executor_wait.cap_spin(None)


def test_the_connector_caps_cpu_engines_and_leaves_vllms_own_on_request() -> None:
    from types import SimpleNamespace

    from kvd.integrations.connector_core.settings import ConnectorSettings
    from kvd.integrations.vllm.connector import CPU_QUEUE_SPIN_S, cap_queue_spin

    def settings(**extra: object) -> ConnectorSettings:
        return ConnectorSettings.from_vllm(SimpleNamespace(
            engine_id="e", kv_connector_extra_config={"kvd_address": "tcp://127.0.0.1:1",
                                                      **extra}))

    try:
        assert cap_queue_spin(settings()) == CPU_QUEUE_SPIN_S  # vLLM here runs on CPU
        assert executor_wait._state["spin_s"] == CPU_QUEUE_SPIN_S
        assert cap_queue_spin(settings(kvd_queue_spin_s=0.02)) == 0.02
        assert cap_queue_spin(settings(kvd_queue_spin_s=1)) is None
        assert executor_wait._state["spin_s"] is None
    finally:
        executor_wait.cap_spin(None)

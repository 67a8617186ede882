"""A batch's hand-overs land together, and an empty step waits for kvd's events
instead of spinning.

* The pulls the scheduler sent in one step are reported to vLLM in one step: a finished
  receive is held until every pull of its step has an outcome. Measured with whole
  engines before this (``kvd bench vllm --breakdown``, one daemon): six pulls sent in
  one step, their events queued over 52 ms as the daemon took them one by one, one
  taken by the decode 56 ms before the other five, first tokens 18 ms (3 steps) apart.
* A step that computes nothing while transfers are out parks a poll at the daemon and
  waits for its reply in the kernel, woken the moment the event comes: before this the
  rank-0 worker took events only at step ends, spinning through empty steps meanwhile.
"""

from __future__ import annotations

import time

from support.connector_fakes import FakeDaemon

from kvd.client import EventCursor
from kvd.integrations.connector_core.completions import EventPoller, EventPump
from kvd.integrations.connector_core.events import GROUP_HOLD_S, EventBook
from kvd.integrations.connector_core.messages import StepAnnouncements
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.wire.protocol import Event


def ev(rid: str, ok: bool = True) -> Event:
    return Event(kind="done_recving", request_id=rid, ok=ok, nbytes=100 if ok else 0,
                 invalid_block_ids=[] if ok else [1], duration_s=0.01)


def test_pulls_of_one_step_are_reported_together() -> None:
    book = EventBook()
    book.announce_step({"a": [1], "b": [2], "c": [3]}, deadline_s=100.0, group=1)
    book.on_event(ev("a"))
    book.on_event(ev("b"))
    assert book.take().finished_recving == frozenset()  # c is still being copied
    book.on_event(ev("c"))
    assert book.take().finished_recving == {"a", "b", "c"}
    assert book.take().finished_recving == frozenset()


def test_pulls_of_different_steps_do_not_wait_for_each_other() -> None:
    book = EventBook()
    book.announce_step({"a": [1]}, deadline_s=100.0, group=1)
    book.announce_step({"b": [2]}, deadline_s=100.0, group=2)
    book.on_event(ev("a"))
    assert book.take().finished_recving == {"a"}


def test_a_failure_is_reported_at_once_and_does_not_hold_the_rest() -> None:
    book = EventBook()
    book.announce_step({"a": [1], "b": [2]}, deadline_s=100.0, group=1)
    book.on_event(ev("a"))
    book.on_event(ev("b", ok=False))
    report = book.take()
    assert report.finished_recving == {"a", "b"} and report.invalid_block_ids == {1}


def test_an_event_that_overtook_its_step_waits_for_the_step() -> None:
    book = EventBook()
    book.on_event(ev("a"))  # the daemon's event came before the step's metadata
    book.announce_step({"a": [1], "b": [2]}, deadline_s=100.0, group=1)
    assert book.take().finished_recving == frozenset()
    book.on_event(ev("b"))
    assert book.take().finished_recving == {"a", "b"}


def test_the_hold_is_bounded_and_a_straggler_lands_alone() -> None:
    book = EventBook()
    book.announce_step({"a": [1], "b": [2]}, deadline_s=100.0, group=1)
    book.on_event(ev("a"))
    book.expire(10.0)  # the first step that sees it held starts the clock
    assert book.take().finished_recving == frozenset()
    book.expire(10.0 + GROUP_HOLD_S)
    assert book.take().finished_recving == {"a"}
    book.on_event(ev("b"))
    assert book.take().finished_recving == {"b"}


def test_a_daemon_restart_releases_what_was_held() -> None:
    book = EventBook()
    book.announce_step({"a": [1], "b": [2]}, deadline_s=100.0, group=1)
    book.on_event(ev("a"))
    book.daemon_restarted()
    report = book.take()
    assert report.finished_recving == {"a", "b"} and report.invalid_block_ids == {2}


def _settings(address: str) -> ConnectorSettings:
    return ConnectorSettings(engine_id="decode-0", address=address, token="", lease_s=None,
                             consumers=1, pull_timeout_s=120.0, kv_layout=None,
                             model_name=None, request_timeout_s=10.0)


def test_the_scheduler_tells_the_workers_which_steps_compute_nothing() -> None:
    sched = KvdScheduler(_settings("tcp://127.0.0.1:1"), block_size_tokens=32)
    assert sched.build_meta(idle=True).idle is True
    assert sched.build_meta().idle is False
    assert StepAnnouncements().idle is False


def test_an_empty_step_waits_for_the_event_and_takes_it_in_that_step() -> None:
    daemon = FakeDaemon(delay_s=0.05)
    cursor = EventCursor("decode-0")
    pump = EventPump(_settings(daemon.address), cursor, time.monotonic)
    try:
        pump.kick(park_s=1.0)  # the step computes nothing: a parked poll
        t0 = time.monotonic()
        taken = pump.drain(wait_s=1.0)
        waited_s = time.monotonic() - t0
        assert taken == 1 and [e.request_id for e in cursor.take()] == ["r1"]
        assert daemon.parked_s == [1.0]
        assert waited_s < 0.9  # woken by the reply, not by the bound
    finally:
        pump.close()
        daemon.close()


def test_a_busy_step_never_waits() -> None:
    daemon = FakeDaemon(delay_s=0.2)
    cursor = EventCursor("decode-0")
    pump = EventPump(_settings(daemon.address), cursor, time.monotonic)
    try:
        pump.kick()
        t0 = time.monotonic()
        assert pump.drain() == 0
        assert time.monotonic() - t0 < 0.05
        assert daemon.parked_s in ([], [0.0])  # answered at once by a real daemon
    finally:
        pump.close()
        daemon.close()


def test_the_fallback_poller_stands_down_while_the_engine_steps() -> None:
    """Steps take the events themselves (EventPump); a second thread woken by the same
    reply would contend with the step for the GIL. Once steps stop, it polls again."""
    daemon = FakeDaemon(delay_s=0.0)
    cursor = EventCursor("decode-0")
    poller = EventPoller(_settings(daemon.address), cursor, time.monotonic)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5 * EventPoller.POLL_S:
            poller.note_step(time.monotonic())
            time.sleep(0.01)
        assert daemon.parked_s == []  # no poll while steps came
        stopped_s = time.monotonic()
        while not daemon.parked_s and time.monotonic() - stopped_s < 5.0:
            time.sleep(0.01)
        assert daemon.parked_s == [EventPoller.POLL_S]  # the idle engine's long poll
        assert time.monotonic() - stopped_s < EventPoller.POLL_S + 1.0
    finally:
        poller.close()
        daemon.close()


def test_a_step_does_not_park_for_an_event_the_fallback_poller_already_took() -> None:
    """An idle engine's fallback poller long-polls; a local pull can end, and its event
    reach that poller, before the worker wakes for the step that sent the pull. That
    step's own poll (acknowledging the event) then had nothing to wait for, and it waited
    its whole park: in whole engines 6-8 ms between the daemon's reply and the event
    taken, in 4 of 6 single hand-overs of kvd-1d (run 23), against 0.2-1.5 ms otherwise.
    It now reports the event at its end without parking."""
    from types import SimpleNamespace

    from kvd.integrations.connector_core.worker import KvdWorker
    from kvd.wire import protocol as P

    daemon = FakeDaemon(delay_s=1.0)  # nothing new for the step's poll
    worker = KvdWorker(ConnectorSettings(
        engine_id="decode-0", address=daemon.address, token="", lease_s=None, consumers=1,
        pull_timeout_s=120.0, kv_layout=None, model_name=None, request_timeout_s=10.0,
        idle_wait_s=0.5), SimpleNamespace(tp_rank=0, pp_rank=0))  # type: ignore[arg-type]
    worker.pump = EventPump(worker.settings, worker.cursor, time.monotonic)
    try:
        # the fallback poller's reply, taken on its thread before the step began
        worker.cursor.accept(P.Events(events=[Event(
            kind="done_recving", request_id="r1", ok=True, nbytes=100, seq=1,
            invalid_block_ids=[], duration_s=0.001)], instance_id="i1"))
        worker.on_metadata(StepAnnouncements(recv={"r1": [1]}, idle=True))
        assert worker.step_wait_s == 0.0
        t0 = time.monotonic()
        report = worker.step(set())
        assert report.finished_recving == {"r1"}
        assert time.monotonic() - t0 < 0.1
        # and a step's drain that finds them so does not wait either
        worker.cursor.accept(P.Events(events=[Event(
            kind="done_recving", request_id="r2", ok=True, nbytes=100, seq=2,
            invalid_block_ids=[], duration_s=0.001)], instance_id="i1"))
        t0 = time.monotonic()
        worker.pump.drain(wait_s=0.5)
        assert time.monotonic() - t0 < 0.1
    finally:
        worker.close()
        daemon.close()

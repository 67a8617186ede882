"""A batch's hand-overs land together.

* The pulls the scheduler sent in one step are reported to vLLM in one step: a finished
  receive is held until every pull of its step has an outcome. Measured with whole
  engines before this (``kvd bench vllm --breakdown``, one daemon): six pulls sent in
  one step, their events queued over 52 ms as the daemon took them one by one, one
  taken by the decode 56 ms before the other five, first tokens 18 ms (3 steps) apart.
"""

from __future__ import annotations

from kvd.integrations.connector_core.events import GROUP_HOLD_S, EventBook
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

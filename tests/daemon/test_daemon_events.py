"""Completion events: long-poll delivery, timeouts on an injected clock, nothing lost."""

from __future__ import annotations

from support.clock import FakeClock

from kvd.daemon import events as E
from kvd.daemon.events import EventHub
from kvd.wire import protocol as P


def hub(**kw) -> tuple[EventHub, FakeClock, list[tuple[bytes, int, list[P.Event]]]]:
    sent: list[tuple[bytes, int, list[P.Event]]] = []
    clock = FakeClock()
    h = EventHub(lambda ident, msg_id, evs: sent.append((ident, msg_id, list(evs.events))),
                 clock.now, **kw)
    return h, clock, sent


def ev(rid: str, kind: str = "done_recving") -> P.Event:
    return P.Event(kind=kind, request_id=rid, ok=True)


def test_waiting_poll_is_answered_as_soon_as_an_event_arrives() -> None:
    h, _, sent = hub()
    h.wait("e", b"id1", 7, timeout_s=5.0, max_events=10)
    assert sent == []
    h.push("e", ev("r1"))
    assert sent == [(b"id1", 7, [ev("r1")])]
    assert h.waiters["e"] == []


def test_events_without_a_waiter_are_kept_until_polled() -> None:
    h, _, sent = hub()
    h.push("e", ev("r1"))
    h.push("e", ev("r2", "done_sending"))
    h.push("other", ev("x"))
    assert sent == []
    h.wait("e", b"a", 1, 5.0, 10)
    assert sent == [(b"a", 1, [ev("r1"), ev("r2", "done_sending")])]
    h.wait("other", b"b", 2, 5.0, 10)
    assert sent[-1] == (b"b", 2, [ev("x")])


def test_max_events_splits_batches_without_loss() -> None:
    h, _, sent = hub()
    for i in range(5):
        h.push("e", ev(f"r{i}"))
    h.wait("e", b"a", 1, 5.0, max_events=2)
    h.wait("e", b"a", 2, 5.0, max_events=2)
    h.wait("e", b"a", 3, 5.0, max_events=2)
    got = [e.request_id for _, _, evs in sent for e in evs]
    assert got == [f"r{i}" for i in range(5)]
    assert [len(evs) for _, _, evs in sent] == [2, 2, 1]


def test_poll_times_out_empty_on_the_injected_clock() -> None:
    h, clock, sent = hub()
    h.wait("e", b"a", 1, timeout_s=2.0, max_events=10)
    clock.advance(1.999)
    h.expire()
    assert sent == []
    clock.advance(0.001)
    h.expire()
    assert sent == [(b"a", 1, [])]
    h.expire()
    assert len(sent) == 1  # answered once
    h.push("e", ev("late"))  # no waiter now: kept, not lost
    h.wait("e", b"a", 2, 2.0, 10)
    assert sent[-1] == (b"a", 2, [ev("late")])


def test_timeouts_are_clamped() -> None:
    h, clock, sent = hub()
    h.wait("e", b"a", 1, timeout_s=-5.0, max_events=0)  # (refused at decode) answered now
    assert sent == [(b"a", 1, [])]
    h.wait("e", b"b", 2, timeout_s=1e9, max_events=10)  # huge: capped at 60 s
    clock.advance(60.0)
    h.expire()
    assert sent[-1] == (b"b", 2, [])


def test_waiters_are_served_in_order() -> None:
    h, _, sent = hub()
    h.wait("e", b"first", 1, 5.0, 10)
    h.wait("e", b"second", 2, 5.0, 10)
    h.push("e", ev("r1"))
    h.push("e", ev("r2"))
    assert [(ident, [e.request_id for e in evs]) for ident, _, evs in sent] == [
        (b"first", ["r1"]), (b"second", ["r2"])]


def test_flush_all_answers_every_waiter() -> None:
    h, _, sent = hub()
    h.wait("e", b"a", 1, 5.0, 10)
    h.wait("f", b"b", 2, 5.0, 10)
    h.flush_all()
    assert sorted(sent) == [(b"a", 1, []), (b"b", 2, [])]


def test_a_zero_timeout_poll_is_answered_at_once() -> None:
    h, _, sent = hub()
    h.wait("e", b"a", 1, timeout_s=0.0, max_events=10)
    assert sent == [(b"a", 1, [])]


def test_dropped_events_are_counted() -> None:
    drops: list[int] = []
    h, _, _ = hub(on_drop=lambda: drops.append(1))
    for i in range(E.MAX_EVENTS_PER_ENGINE + 3):
        h.push("e", ev(f"r{i}"))
    assert len(drops) == 3 and len(h.queues["e"]) == E.MAX_EVENTS_PER_ENGINE
    assert h.queues["e"][0].request_id == "r3"  # the oldest went first


def test_a_burst_of_one_loop_iteration_is_one_reply() -> None:
    scheduled: list = []
    h, _, sent = hub(schedule=scheduled.append)
    h.wait("e", b"a", 1, 5.0, 10)
    for i in range(3):
        h.push("e", ev(f"r{i}"))
    assert sent == [] and len(scheduled) == 1  # one delivery for the burst
    scheduled.pop()()
    assert sent == [(b"a", 1, [ev("r0"), ev("r1"), ev("r2")])]

"""The producer's held-request state machine, driven by an explicit clock (no sleeping)."""

from __future__ import annotations

import pytest

from kvd.daemon.produce.held import TERMINAL, HeldState, HeldTable, Reader
from kvd.errors import BlockIdError, BusyError, KvdError, NotFoundError


def table(max_held: int = 100) -> HeldTable:
    return HeldTable(max_held)


def test_publish_holds_with_a_lease_from_now() -> None:
    t = table()
    h = t.publish("p", "r1", [1, 2, 3], lease_s=5.0, consumers=1, now_s=100.0)
    assert h.state is HeldState.HELD
    assert h.deadline_s == 105.0
    assert t.get("p", "r1") is h
    assert len(t) == 1


def test_duplicate_publish_is_refused_but_other_engine_may_reuse_the_id() -> None:
    t = table()
    t.publish("p", "r1", [1], 5.0, 1, 0.0)
    with pytest.raises(KvdError, match="already published"):
        t.publish("p", "r1", [2], 5.0, 1, 0.0)
    t.publish("q", "r1", [2], 5.0, 1, 0.0)
    assert len(t) == 2


def test_table_is_bounded() -> None:
    t = table(max_held=2)
    t.publish("p", "a", [1], 5.0, 1, 0.0)
    t.publish("p", "b", [1], 5.0, 1, 0.0)
    with pytest.raises(BusyError):
        t.publish("p", "c", [1], 5.0, 1, 0.0)


def test_unknown_request_is_not_found() -> None:
    with pytest.raises(NotFoundError, match="never published"):
        table().get("p", "nope")


def test_acquire_checks_blocks_moves_to_reading_and_renews() -> None:
    t = table()
    h = t.publish("p", "r", [1, 2, 3], 5.0, 1, 0.0)
    with pytest.raises(BlockIdError, match="not published"):
        h.acquire("c", [3, 4], now_s=1.0)
    assert h.state is HeldState.HELD  # a refused acquire changes nothing
    h.acquire("c", [2, 3], now_s=4.0, expected_reads=3, instance="i1")
    assert h.state is HeldState.READING
    assert h.deadline_s == 9.0
    assert h.readers == {"c": Reader(expected_reads=3, instance="i1")}


def test_renew_never_shortens_a_lease() -> None:
    h = table().publish("p", "r", [1], 10.0, 1, 0.0)
    h.renew(now_s=-5.0)  # an older timestamp must not pull the deadline in
    assert h.deadline_s == 10.0
    h.renew(now_s=3.0)
    assert h.deadline_s == 13.0


def test_an_engines_short_lease_bounds_the_wait_not_a_read_under_way() -> None:
    """An engine may publish with a lease shorter than the daemon's (Publish.lease_s). Once
    a consumer acquired, renewals (the Acquire, heartbeats every heartbeat_interval_s)
    never give less than the daemon's lease_s: a 0.5 s lease used to lapse between two
    heartbeats under a READ still running, and the engine reused the blocks under it."""
    h = table().publish("p", "r", [1], 0.5, 1, 0.0, reading_lease_s=30.0)
    assert h.deadline_s == 0.5  # nobody came yet: the engine's own lease
    h.acquire("c", [1], now_s=0.2)
    assert h.deadline_s == 30.2 and not h.expired(2.2)  # a heartbeat later: still held
    h.renew(now_s=2.0)
    assert h.deadline_s == 32.0
    unread = table().publish("p", "q", [1], 0.5, 1, 0.0, reading_lease_s=30.0)
    unread.renew(now_s=0.3)
    assert unread.deadline_s == 0.8 and unread.expired(0.8)


def test_expiry_exactly_at_the_deadline() -> None:
    t = table()
    h = t.publish("p", "r", [1], 2.0, 1, 10.0)
    assert not h.expired(11.999)
    assert t.expired(11.999) == []
    assert h.expired(12.0)
    assert t.expired(12.0) == [h]


def test_never_expires_while_heartbeats_renew_it() -> None:
    h = table().publish("p", "r", [1], 1.0, 1, 0.0)
    h.acquire("c", [1], 0.5)
    now = 0.5
    for _ in range(1000):  # 500 simulated seconds of heartbeats every 0.5 s
        now += 0.5
        assert not h.expired(now)
        h.renew(now)
    assert not h.expired(now + 0.99)
    assert h.expired(now + 1.0)


def test_notices_count_reads_per_consumer_engine() -> None:
    h = table().publish("p", "r", [1], 5.0, consumers=2, now_s=0.0)
    h.acquire("c1", [1], 0.0, expected_reads=2)
    h.acquire("c2", [1], 0.0, expected_reads=2)
    assert not h.notice("c1", reads=1, nbytes=100)
    assert not h.notice("c1", reads=1, nbytes=100)  # c1 done
    assert h.consumers_done == {"c1"}
    assert not h.notice("c1", reads=1)  # c1 again does not count twice
    assert h.state is HeldState.READING
    assert h.notice("c2", reads=2, nbytes=300)
    assert h.state is HeldState.DONE
    assert h.nbytes == 500
    assert not h.notice("c2", reads=2)  # terminal: ignored


def test_a_notice_with_zero_reads_does_not_release_when_reads_were_expected() -> None:
    h = table().publish("p", "r", [1], 5.0, 1, 0.0)
    h.acquire("c", [1], 0.0, expected_reads=2)
    assert not h.notice("c", reads=0)
    assert h.state is HeldState.READING


def test_a_notice_from_a_consumer_that_never_acquired_is_ignored() -> None:
    h = table().publish("p", "r", [1], 5.0, 1, 0.0)
    assert not h.notice("stranger", reads=100)
    assert h.state is HeldState.HELD and h.consumers_done == set()


def test_a_restarted_consumer_daemon_starts_its_count_over() -> None:
    """Reads counted for the consumer's previous incarnation died with it."""
    h = table().publish("p", "r", [1], 5.0, 1, 0.0)
    h.acquire("c", [1], 0.0, expected_reads=2, instance="old")
    assert not h.notice("c", reads=1)
    h.acquire("c", [1], 1.0, expected_reads=2, instance="new")
    assert not h.notice("c", reads=1), "the old incarnation's read must not count"
    assert h.notice("c", reads=1)
    assert h.state is HeldState.DONE


def test_terminal_states_refuse_acquire_and_do_not_expire() -> None:
    t = table()
    for state in TERMINAL:
        h = t.publish("p", f"r-{state.value}", [1], 1.0, 1, 0.0)
        if state is HeldState.DONE:  # read by its consumer: the only way to DONE
            h.acquire("c", [1], 0.0)
            assert h.notice("c", 1)
        h.end({HeldState.DONE: "ok", HeldState.EXPIRED: "expired"}.get(state, "cancelled"))
        assert h.state is state
        with pytest.raises(NotFoundError, match="no longer held"):
            h.acquire("c", [1], 0.0)
        assert not h.expired(100.0)
        before = h.deadline_s
        h.renew(50.0)
        assert h.deadline_s == before


def test_pop_and_of_engine() -> None:
    t = table()
    a = t.publish("p", "a", [1], 1.0, 1, 0.0)
    t.publish("q", "b", [1], 1.0, 1, 0.0)
    assert t.of_engine("p") == [a]
    t.pop(a)
    t.pop(a)  # idempotent
    assert t.of_engine("p") == []
    with pytest.raises(NotFoundError):
        t.get("p", "a")


def test_abandon_releases_once_every_consumer_is_done_or_gave_up() -> None:
    table = HeldTable(max_held=4)
    held = table.publish("p", "r", [1, 2], lease_s=10.0, consumers=2, now_s=0.0)
    held.acquire("c1", [1], now_s=1.0)
    held.acquire("c2", [2], now_s=1.0)
    assert not held.abandon("c1")  # c2 may still read
    assert held.state is HeldState.READING
    assert held.notice("c2", reads=1)
    assert held.state is HeldState.DONE
    assert not held.abandon("c2"), "a terminal hold never changes again"


def test_an_abandon_from_an_earlier_consumer_incarnation_is_stale() -> None:
    """Sent before its daemon restarted, it came in after the new incarnation's Acquire
    (another connection): the new one reads, the hold stays (found by the fleet
    simulation, tests/daemon/test_fleet_sim.py)."""
    t = table()
    h = t.publish("p", "r1", [1], 5.0, 1, 0.0)
    h.acquire("c", [1], 1.0, instance="c.1")
    h.acquire("c", [1], 2.0, instance="c.2")  # restarted: its count starts over
    assert not h.abandon("c", "c.1") and h.state is HeldState.READING
    assert h.abandon("c", "c.2") and h.state is HeldState.RELEASED


def test_a_holds_lifecycle_is_one_table() -> None:
    """Every state has a row, the terminal ones are final, and only `_to` assigns."""
    import inspect

    from kvd.daemon import transitions as T
    from kvd.daemon.produce import held as H

    assert set(H.TRANSITIONS) == set(H.HeldState)
    for state in H.TERMINAL:
        assert H.TRANSITIONS[state] == {}
    assert H.TRANSITIONS[H.HeldState.HELD][H.HeldOn.ACQUIRE] is H.HeldState.READING
    assert H.HeldOn.ALL_READ not in H.TRANSITIONS[H.HeldState.HELD]  # reads need a reader
    src = inspect.getsource(H)
    assert src.count("self.state = ") == 1 and "self.state = next_held_state(" in src
    h = table().publish("p", "r", [1], 10.0, 1, 0.0)
    h.end("expired")
    with pytest.raises(T.BadTransition):
        h._to(H.HeldOn.ACQUIRE)

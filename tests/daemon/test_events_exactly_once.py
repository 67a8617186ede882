"""Every completion event reaches the engine exactly once, whatever happens to the replies.

The daemon's ``EventHub`` in acknowledged mode (``Poll.ack``) and the client's
``EventCursor``, joined by a transport that drops, delays, duplicates and reorders
replies, with several pollers sharing one cursor. Without acknowledgements (the
plain mode every client used before) a dropped reply loses its events: the last
test shows it, so the property tests are known to catch a loss.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import FakeClock
from support.inprocess import daemon_pair, run

from kvd.client import EventCursor
from kvd.daemon.events import EventHub
from kvd.errors import KvdTimeoutError
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P

ENGINE = "e"


@dataclass
class Lossy:
    """The hub's replies in flight: a fault-injecting transport toward the client."""

    in_flight: list[P.Events] = field(default_factory=list)

    def reply(self, _identity: bytes, _msg_id: int, events: P.Events) -> None:
        self.in_flight.append(events)


class World:
    def __init__(self, instance: str = "i1") -> None:
        self.clock = FakeClock()
        self.net = Lossy()
        self.hub = EventHub(self.net.reply, self.clock.now, instance_id=instance)
        self.cursor = EventCursor(ENGINE)
        self.pushed: list[str] = []
        self.taken: Counter[str] = Counter()
        self._ids = 0

    def push(self) -> None:
        rid = f"r{len(self.pushed)}"
        self.pushed.append(rid)
        self.hub.push(ENGINE, P.Event(kind="done_recving", request_id=rid, ok=True))

    def poll(self, max_events: int, long: bool) -> None:
        self._ids += 1
        msg = self.cursor.poll(timeout_s=5.0 if long else 0.0, max_events=max_events)
        self.hub.wait(ENGINE, b"c", self._ids, msg.timeout_s, msg.max_events, ack=msg.ack,
                      ack_instance=msg.ack_instance)

    def deliver(self, i: int) -> None:
        if self.net.in_flight:
            self.cursor.accept(self.net.in_flight.pop(i % len(self.net.in_flight)))
        self.take()

    def take(self) -> None:
        self.taken.update(e.request_id for e in self.cursor.take())

    def settle(self) -> None:
        """The faults stop: drop what is in flight, poll until nothing new comes."""
        self.clock.advance(10.0)
        self.hub.expire()
        self.net.in_flight.clear()
        for _ in range(len(self.pushed) + 2):
            self.poll(max_events=P.MAX_POLL_EVENTS, long=False)
            while self.net.in_flight:
                self.deliver(0)

    def check_exactly_once(self) -> None:
        dup = {r: n for r, n in self.taken.items() if n > 1}
        lost = [r for r in self.pushed if r not in self.taken]
        assert not dup, f"events taken more than once: {dup}"
        assert not lost, f"events never taken: {lost}"


OPS = st.lists(st.one_of(
    st.tuples(st.just("push")),
    st.tuples(st.just("poll"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("deliver"), st.integers(0, 50)),
    st.tuples(st.just("drop"), st.integers(0, 50)),
    st.tuples(st.just("dup"), st.integers(0, 50)),
), max_size=80)


def run_ops(w: World, ops: list[tuple]) -> None:
    for op in ops:
        if op[0] == "push":
            w.push()
        elif op[0] == "poll":
            w.poll(op[1], op[2])
        elif op[0] == "deliver":
            w.deliver(op[1])
        elif w.net.in_flight:
            i = op[1] % len(w.net.in_flight)
            if op[0] == "drop":
                w.net.in_flight.pop(i)
            else:
                w.net.in_flight.append(w.net.in_flight[i])
        assert max(w.taken.values(), default=0) <= 1, "an event was taken twice"


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_lost_late_duplicated_and_reordered_replies_deliver_each_event_once(ops) -> None:
    w = World()
    run_ops(w, ops)
    w.settle()
    w.check_exactly_once()


@settings(max_examples=150, deadline=None)
@given(OPS, OPS)
def test_a_daemon_restart_starts_the_count_again_and_late_replies_of_the_old_one_are_dropped(
        before, after) -> None:
    """Events of the old incarnation still in flight may arrive after the new one's: they
    are dropped whole (the engine learned of the restart and failed what was in flight),
    and the new incarnation's events, whose seq start again at 1, all arrive once."""
    w = World("old")
    w.poll(1, False)
    w.deliver(0)  # the engine has heard from the old incarnation
    run_ops(w, before)
    stale = list(w.net.in_flight)
    w.hub = EventHub(w.net.reply, w.clock.now, instance_id="new")  # the restart
    w.net.in_flight.clear()
    old_taken = Counter(w.taken)
    first_new = len(w.pushed)
    w.push()  # the new daemon has something to say, so its instance is seen
    w.poll(1, False)
    w.deliver(0)
    w.net.in_flight.extend(stale)
    run_ops(w, after)
    w.settle()
    new = w.pushed[first_new:]
    assert all(w.taken[r] == 1 for r in new), (new, w.taken)
    assert all(w.taken[r] == n for r, n in old_taken.items()), "old events came again"
    assert w.cursor.restarts == 1


def test_ten_thousand_random_faults_lose_and_duplicate_nothing() -> None:
    """The figure for the reliability docs: lost and duplicated events under fault injection."""
    rng = random.Random(20)
    w = World()
    for _ in range(10_000):
        r = rng.random()
        if r < 0.25:
            w.push()
        elif r < 0.5:
            w.poll(rng.randint(1, 8), rng.random() < 0.3)
        elif r < 0.7:
            w.deliver(rng.randrange(50))
        elif w.net.in_flight and r < 0.85:
            w.net.in_flight.pop(rng.randrange(len(w.net.in_flight)))
        elif w.net.in_flight:
            w.net.in_flight.append(rng.choice(w.net.in_flight))
    w.settle()
    dup = sum(n - 1 for n in w.taken.values() if n > 1)
    lost = sum(1 for r in w.pushed if r not in w.taken)
    print(f"pushed={len(w.pushed)} lost={lost} duplicated={dup} "
          f"duplicates_dropped_by_cursor={w.cursor.duplicates}")
    assert (lost, dup) == (0, 0)
    assert w.cursor.duplicates > 0, "the faults must have produced duplicates to drop"


def test_plain_polls_lose_the_events_of_a_dropped_reply() -> None:
    """Why acknowledgements: in the plain mode a reply nobody reads takes its events."""
    w = World()
    w.push()
    w.hub.wait(ENGINE, b"c", 1, 0.0, 10)  # plain poll; its reply is lost
    w.net.in_flight.clear()
    w.hub.wait(ENGINE, b"c", 2, 0.0, 10)
    assert w.net.in_flight == [P.Events(events=[])]


def test_a_real_daemon_redelivers_what_a_client_gave_up_on_and_nothing_twice() -> None:
    """Against a daemon over its socket: a long poll the client gave up on is answered
    later with an event (the reply goes nowhere); the next acknowledged poll still gets
    it, a poll acknowledging it gets nothing, and duplicate replies are dropped."""
    model = P.ModelSpec(name="ev", num_kv_heads=4, num_layers=2, head_dim=32)
    shape = EngineShape(tp_size=1, block_size_tokens=16, num_blocks=8,
                        kv_layout="head_major")

    async def body() -> None:
        async with daemon_pair() as p:
            await p.dc.register("dec", model, layout_spec(shape), 0, 1)
            cursor = EventCursor("dec")
            try:  # the client gives up on a long poll...
                await p.dc.call(cursor.poll(timeout_s=30.0), timeout_s=0.05)
            except KvdTimeoutError:
                pass
            p.decode.events.push("dec", P.Event(kind="done_recving", request_id="r1",
                                                ok=True))  # ...the daemon answers it
            await asyncio.sleep(0.05)
            first = await p.dc.call(cursor.poll(timeout_s=0.0))
            assert [e.request_id for e in first.events] == ["r1"]
            assert first.instance_id == p.decode.instance_id
            assert cursor.accept(first) == 1 and cursor.accept(first) == 0
            assert [e.request_id for e in cursor.take()] == ["r1"]
            again = await p.dc.call(cursor.poll(timeout_s=0.0))
            assert again.events == [], "an acknowledged event came again"
            # the plain mode, for contrast: the reply of a poll given up on loses r2
            try:
                await p.dc.call(P.Poll(engine_id="dec", timeout_s=30.0), timeout_s=0.05)
            except KvdTimeoutError:
                pass
            p.decode.events.push("dec", P.Event(kind="done_recving", request_id="r2",
                                                ok=True))
            await asyncio.sleep(0.05)
            assert await p.dc.poll("dec", timeout_s=0.0) == []

    run(body())

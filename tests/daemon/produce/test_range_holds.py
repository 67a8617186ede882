"""The producer's range holds (a progressive pull's reads, kvd.daemon.produce.producer
`_hold_range`), against in-memory fakes of what the real `Producer` touches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.fleet.fakes import NOP, FakeEvents, FakeRegistry

from kvd.config import Config
from kvd.daemon.produce.producer import Producer
from kvd.errors import NotFoundError
from kvd.pool.geometry import parallelism
from kvd.wire import protocol as P


class Rank:
    def __init__(self) -> None:
        self.pins = 0
        self.gone = False


class Registration:
    """One registration of the prefill engine: its pool's rank, its epoch."""

    model = P.ModelSpec(name="m", num_kv_heads=2, num_layers=1, head_dim=8)
    par = parallelism(1, 1, None)

    def __init__(self, epoch: int) -> None:
        self.engine_id = "pre"
        self.epoch = epoch
        self.rank = Rank()
        self.layout = SimpleNamespace(num_blocks=16, block_size_tokens=4)

    def live_ranks(self) -> list[Rank]:
        return [] if self.rank.gone else [self.rank]


def range_acquire(generation: int, start: int, end: int) -> P.Acquire:
    return P.Acquire(request_id=P.range_request_id("r", generation, start, end, "n0"),
                     producer_engine_id="pre", consumer_engine_id="dec", block_ids=[])


def test_a_range_of_a_request_sealed_by_a_registration_since_gone_is_refused() -> None:
    """Found by the fleet simulation (seed 378 of Knobs(prog_ops=10)): the prefill engine
    sealed a request complete, then left and registered again (a new pool) while the
    decode's daemon read its first range. Its next range's Acquire made a range hold
    pinning the new registration; the consumer, seeing the new epoch, greeted the engine
    again and read the sealed block ids out of the new pool: ok with wrong bytes."""
    registry = FakeRegistry()
    clock = SimpleNamespace(now=lambda: 10.0)
    svc = SimpleNamespace(cfg=Config(), clock=clock, registry=registry, metrics=NOP,
                          events=FakeEvents(SimpleNamespace(deliver_event=lambda *_: None)),
                          instance_id="p.1", spans=None)
    producer = Producer(svc)  # type: ignore[arg-type]
    old = Registration(epoch=1)
    registry.engines["pre"] = old  # type: ignore[assignment]
    producer.seal(P.Seal(engine_id="pre", request_id="r", block_ids=[3, 4], num_tokens=8,
                         complete=True))
    assert not producer.acquire_must_wait(range_acquire(0, 0, 4))  # read while it is here
    old.rank.gone = True  # it leaves (its pool kept: pinned) and registers again
    del registry.engines["pre"]
    registry.gone("pre")
    new = Registration(epoch=2)
    registry.engines["pre"] = new  # type: ignore[assignment]
    with pytest.raises(NotFoundError, match="left after sealing it"):
        producer.acquire_must_wait(range_acquire(0, 4, 8))
    assert new.rank.pins == 0
    assert ("pre", range_acquire(0, 4, 8).request_id) not in producer.held.items


def test_a_progressive_hold_outlives_the_range_being_read() -> None:
    """Found by the fleet simulation (seed 845 of Knobs(prog_ops=10, prog_local_p=0.5)):
    a decode's daemon read the one range of a request sealed complete, its READ slowed
    (a late descriptor), its heartbeats renewing the range hold. The progressive hold's
    own lease, renewed only by seals, Watches and the range's Acquire, ran out under the
    READ: it ended (done_sending, the engine freed and reused the blocks) and the READ
    then copied the reused blocks. The decode's done was lost (a delayed link), which it
    takes as ok (the hold left to its lease): ok with wrong bytes. A progressive hold
    now never ends by its lease while a range of it is held (each range has its own
    lease, renewed by its reader), and a range's end renews it."""
    registry = FakeRegistry()
    now = [10.0]
    clock = SimpleNamespace(now=lambda: now[0])
    pushed: list[P.Event] = []
    events = SimpleNamespace(push=lambda engine_id, event: pushed.append(event))
    cfg = Config()
    svc = SimpleNamespace(cfg=cfg, clock=clock, registry=registry, metrics=NOP, events=events,
                          instance_id="p.1", spans=None)
    producer = Producer(svc)  # type: ignore[arg-type]
    registry.engines["pre"] = Registration(epoch=1)  # type: ignore[assignment]
    producer.seal(P.Seal(engine_id="pre", request_id="r", block_ids=[3, 4], num_tokens=8,
                         complete=True))
    acquire = range_acquire(0, 0, 8)
    assert not producer.acquire_must_wait(acquire)
    producer.acquire(acquire, "d.1")  # the range's READ starts

    def run_until(t: float, beats: bool) -> None:  # housekeeping every 50 ms
        while now[0] < t:
            now[0] = round(now[0] + 0.05, 2)
            if beats and round(now[0] * 100) % 25 == 0:  # the reader's heartbeats
                producer.heartbeat(P.Heartbeat(producer_engine_id="pre",
                                               request_ids=[acquire.request_id]))
            producer.expire(now[0])
            assert not beats or not pushed, "the blocks were handed back under the READ"

    run_until(10.0 + 3 * cfg.lease_s, beats=True)  # a slow READ: three leases
    assert ("pre", acquire.request_id) in producer.held.items
    producer.on_notice(P.ReadNotice(request_id=acquire.request_id, producer_engine_id="pre",
                                    consumer_engine_id="dec", reads=1, nbytes=64), "d.1")
    run_until(now[0] + cfg.lease_s / 2, beats=False)  # time for the decode's done to come
    assert not pushed and ("pre", "r") in producer.opened.items
    run_until(now[0] + cfg.lease_s, beats=False)  # it never came: the lease ends it
    assert [(e.kind, e.ok) for e in pushed] == [("done_sending", False)]

"""The producer's range holds (a progressive pull's reads, kvd.daemon.produce.producer
`_hold_range`), against in-memory fakes of what the real `Producer` touches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.fleet.fakes import NOP, FakeEvents, FakeRegistry

from kvd.config import Config
from kvd.daemon.produce.producer import Producer
from kvd.errors import NotFoundError
from kvd.wire import protocol as P


class Rank:
    def __init__(self) -> None:
        self.pins = 0
        self.gone = False


class Registration:
    """One registration of the prefill engine: its pool's rank, its epoch."""

    model = P.ModelSpec(name="m", num_kv_heads=2, num_layers=1, head_dim=8)

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

"""Progressive holds, sans-IO (kvd.daemon.produce.opened)."""

from __future__ import annotations

import pytest

from kvd.daemon.produce.opened import OpenHold, OpenState
from kvd.errors import ProtocolError


def hold(consumers: int = 1) -> OpenHold:
    return OpenHold(engine_id="pre", request_id="r", consumers=consumers, lease_s=10.0,
                    deadline_s=10.0, opened_s=0.0, hold_id=1, block_size_tokens=16)


def test_seals_extend_then_complete_then_every_consumer_done() -> None:
    h = hold(consumers=2)
    h.seal([3], None, 16, 0, False, 1.0)
    h.seal([3, 4], None, 32, 0, False, 2.0)
    assert h.sealed_since(16) == 1.0 and h.sealed_since(32) == 2.0
    assert h.sealed_since(33) is None
    h.seal([3, 4, 5], None, 40, 0, True, 3.0)
    assert h.state is OpenState.COMPLETE and h.deadline_s == 13.0
    assert not h.done("a", 0)
    assert not h.done("b", 1)  # not the complete generation
    assert h.done("b", 0) and h.state is OpenState.DONE


def test_a_seal_must_extend_and_a_new_generation_drops_the_ranges() -> None:
    h = hold()
    h.seal([3, 4], None, 32, 0, False, 1.0)
    with pytest.raises(ProtocolError):
        h.seal([3, 9], None, 32, 0, False, 1.5)  # a changed block without a new generation
    with pytest.raises(ProtocolError):
        h.seal([3], None, 40, 0, False, 1.5)  # more tokens than its blocks hold
    h.ranges.add("r~~p0.0.32.x")
    assert h.seal([], None, 0, 1, False, 2.0) == ["r~~p0.0.32.x"]
    assert h.generation == 1 and h.ranges == set() and h.sealed_since(1) is None
    with pytest.raises(ProtocolError):
        h.seal([1], None, 16, 0, False, 3.0)  # an older generation
    h.seal([1], None, 16, 1, True, 3.0)
    with pytest.raises(ProtocolError):
        h.seal([], None, 0, 2, False, 4.0)  # complete: never unsealed


def test_a_hybrid_complete_seal_names_its_groups_in_their_own_order() -> None:
    """Progress seals of a hybrid model name its attention blocks; the complete one
    names every group (the Mamba state's first), which need not extend them."""
    h = hold()
    h.seal([3, 4], None, 32, 0, False, 1.0)
    with pytest.raises(ProtocolError):
        h.seal([9, 3, 4, 5], None, 40, 0, True, 2.0)  # no groups: must extend
    with pytest.raises(ProtocolError):
        h.seal([9, 3, 4], [[9], [3, 4]], 16, 0, True, 2.0)  # fewer tokens than sealed
    h.seal([9, 3, 4, 5], [[9], [3, 4, 5]], 40, 0, True, 2.0)
    assert h.state is OpenState.COMPLETE and h.group_block_ids == [[9], [3, 4, 5]]
    assert h.block_ids == [9, 3, 4, 5]


def test_abandon_by_every_consumer_and_end_are_final() -> None:
    h = hold(consumers=2)
    h.seal([1], None, 16, 0, False, 1.0)
    assert not h.abandon("a") and h.abandon("b")
    h.end("every consumer abandoned it")
    assert h.state is OpenState.ENDED and h.terminal
    with pytest.raises(ProtocolError):
        h.seal([1, 2], None, 32, 0, False, 2.0)

"""The progressive pull's decisions, sans-IO (kvd.daemon.pull.progressive.Progressive)."""

from __future__ import annotations

import pytest

from kvd.daemon.pull.progressive import (
    TRANSITIONS,
    Progressive,
    ProgState,
    Report,
    SendDone,
    StartRange,
)
from kvd.daemon.transitions import BadTransition, step
from kvd.errors import LayoutError
from kvd.wire import protocol as P


def prog(tokens: int = 64, local: list[int] | None = None, bs: int = 16,
         hold_s: float = 5.0) -> Progressive:
    local = list(range(100, 100 + tokens // bs)) if local is None else local
    msg = P.Pull(engine_id="dec", request_id="r", remote_engine_id="pre",
                 remote_address="tcp://x:1", remote_block_ids=[], local_block_ids=local,
                 num_tokens=tokens, progressive=True)
    return Progressive(msg=msg, local_block_tokens=bs, started_s=0.0, hold_timeout_s=hold_s)


def sealed(n: int, gen: int = 0, complete: bool = False, bs: int = 16) -> P.Sealed:
    return P.Sealed(state="complete" if complete else "open", generation=gen, num_tokens=n,
                    block_ids=list(range(-(-n // bs))), block_size_tokens=bs)


def ok(nbytes: int = 10) -> P.Event:
    return P.Event(kind="done_recving", request_id="r~~p1", ok=True, nbytes=nbytes)


def test_ranges_follow_the_seals_in_order_then_done_after_complete() -> None:
    p = prog()
    assert p.on_sealed(P.Sealed(state="waiting", num_tokens=-1), 0.1) == []
    [a] = p.on_sealed(sealed(32), 0.2)
    assert isinstance(a, StartRange) and a.msg.local_block_ids == [100, 101]
    assert a.msg.remote_block_ids == [0, 1] and a.msg.num_tokens == 32
    assert P.parse_range_request_id(a.msg.remote_request_id) == ("r", 0, 0, 32)
    assert p.on_sealed(sealed(48), 0.3) == []  # one range at a time
    [b] = p.on_range(ok(), 0.4)
    assert isinstance(b, StartRange) and b.msg.local_block_ids == [102]
    assert p.on_sealed(sealed(64, complete=True), 0.5) == []
    [c] = p.on_range(ok(), 0.6)
    assert c.msg.local_block_ids == [103] and c.end == 64
    [d] = p.on_range(ok(), 0.7)
    assert d == SendDone(0) and p.state is ProgState.CONFIRMING
    [r] = p.on_confirmed(sealed(64, complete=True), 0, 0.8)
    assert isinstance(r, Report) and r.event.ok and r.event.nbytes == 30


def test_an_unseal_while_reading_waits_for_the_range_then_reads_all_again() -> None:
    p = prog()
    [a] = p.on_sealed(sealed(32), 0.1)
    p.on_range(ok(), 0.2)  # [0, 32) read in generation 0 ... and [32, 48) in flight
    [b] = p.on_sealed(sealed(48), 0.3)
    assert p.on_sealed(P.Sealed(state="open", generation=1, num_tokens=0,
                                block_size_tokens=16), 0.4) == []
    assert p.state is ProgState.SETTLING
    assert p.on_sealed(sealed(64, gen=1, complete=True), 0.5) == []  # still in flight
    [c] = p.on_range(ok(), 0.6)  # the old range ended: read everything again
    assert isinstance(c, StartRange) and c.generation == 1
    assert c.msg.local_block_ids == [100, 101, 102, 103] and p.rereads == 1


def test_a_failure_while_reading_reports_only_once_the_range_ended() -> None:
    p = prog()
    p.on_sealed(sealed(32), 0.1)
    assert p.on_tick(10.0) == []  # in flight: FAILING, no report yet
    assert p.state is ProgState.FAILING
    [r] = p.on_range(ok(), 10.1)
    assert isinstance(r, Report) and not r.event.ok
    assert r.event.invalid_block_ids == [100, 101, 102, 103] and r.event.nbytes == 0
    assert "timeout" in r.event.error


def test_a_failed_range_of_the_current_generation_fails_the_pull() -> None:
    p = prog()
    p.on_sealed(sealed(32), 0.1)
    [r] = p.on_range(P.Event(kind="done_recving", request_id="x", ok=False,
                             error="peer_lost: gone"), 0.2)
    assert isinstance(r, Report) and r.event.error.startswith("peer_lost")


def test_an_ended_request_or_an_incomplete_complete_fails() -> None:
    p = prog()
    [r] = p.on_sealed(P.Sealed(state="ended", error="aborted by its engine"), 0.1)
    assert not r.event.ok and "aborted" in r.event.error
    p = prog()
    [r] = p.on_sealed(sealed(48, complete=True), 0.1)
    assert not r.event.ok and "bad_layout" in r.event.error


def test_a_decode_prefix_hit_reads_from_its_end_and_needs_whole_prefill_blocks() -> None:
    p = prog(tokens=64, local=[7, 8])  # tokens [0, 32) are cached here
    [a] = p.on_sealed(sealed(64, complete=True), 0.1)
    assert a.msg.local_block_ids == [7, 8] and a.msg.remote_block_ids == [2, 3]
    p = prog(tokens=64, local=[7, 8, 9])  # a hit of 16 tokens, prefill blocks of 32
    [r] = p.on_sealed(sealed(64, complete=True, bs=32), 0.1)
    assert not r.event.ok and "prefix hit" in r.event.error


def test_no_num_tokens_is_refused_and_the_table_refuses_unlisted_moves() -> None:
    with pytest.raises(LayoutError):
        prog(tokens=-1, local=[1])
    with pytest.raises(BadTransition):
        step(TRANSITIONS, ProgState.DONE, next(iter(TRANSITIONS[ProgState.WATCHING])), "x")

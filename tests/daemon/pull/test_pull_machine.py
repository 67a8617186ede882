"""The consumer's pull as a sans-IO object (kvd.daemon.pull.machine, .state).

Fault cases that used to need two daemon processes, driven here step by step on plain
numbers for time: a READ that fails under a restarted producer, a deadline with a READ
still running, a producer lost mid-READ, a lease lost under a READ, a stale handshake
(twice), a read-again, a refused Acquire with a READ in flight, a drain during a
quarantine, an assembly that fails, and exactly one report whatever follows.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull import consumer as consumer_mod
from kvd.daemon.pull import machine as M
from kvd.daemon.pull.inputs import (
    Begin,
    Greeted,
    Interrupted,
    Polled,
    Probed,
    RanksReady,
    Released,
    RepliesIn,
)
from kvd.daemon.pull.state import (
    LIVE,
    TERMINAL,
    TRANSITIONS,
    BadTransition,
    On,
    Outcome,
    Path,
    PullState,
    diagram,
    next_state,
)
from kvd.errors import BlockIdError, DrainingError, TransferError
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from kvd.wire import protocol as P

ADDR = "tcp://p:1"
AGENT = "agent-p"
LIVENESS_S = 10.0
TIMEOUT_S = 60.0


# ------------------------------------------------------------------ the table


def test_every_state_has_a_row_and_the_terminal_ones_are_final() -> None:
    assert set(TRANSITIONS) == set(PullState)
    for s in TERMINAL:
        assert TRANSITIONS[s] == {}
    for s in LIVE:  # every live pull can fail
        assert TRANSITIONS[s][On.FAIL] is PullState.FAILING
    # a transfer exists only in the read phase: only there can a pull be quarantined
    assert [s for s, moves in TRANSITIONS.items() if On.QUARANTINE in moves] == [
        PullState.READING, PullState.DISCARDING]
    assert TRANSITIONS[PullState.QUARANTINED] == {On.FAIL: PullState.FAILING}
    # reported (DONE, FAILED) only from the ending states, once released
    assert {s for s, moves in TRANSITIONS.items() if set(moves.values()) & set(TERMINAL)} == {
        PullState.RELEASING, PullState.FAILING}


@given(st.lists(st.sampled_from(list(On)), max_size=30))
def test_only_the_table_moves_a_pull(events: list[On]) -> None:
    state = PullState.QUEUED
    for event in events:
        want = TRANSITIONS[state].get(event)
        if want is None:
            with pytest.raises(BadTransition):
                next_state(state, event)
        else:
            state = next_state(state, event)
            assert state is want


def test_the_consumer_docstring_draws_the_table() -> None:
    doc = inspect.getdoc(consumer_mod) or ""
    drawn = [line.strip() for line in doc.splitlines() if "--" in line and "-->" in line]
    assert drawn == diagram().splitlines()


def test_every_state_change_goes_through_the_table() -> None:
    """No module assigns a pull's state but the machine's one `_to`."""
    src = inspect.getsource(M)
    assert src.count("self.state = ") == 1 and "self.state = next_state(" in src


# ------------------------------------------------------------------ a pull, by hand


def _remote(instance: str = "inst-a", epoch: int = 1) -> RemoteEngine:
    return RemoteEngine(desc=None, daemons={  # type: ignore[arg-type] - unused here
        ADDR: RemoteDaemon(ADDR, agent=AGENT, instance=instance, epoch=epoch)})


def _post(nbytes: int = 4096) -> ReadPost:
    one = np.array([nbytes], dtype=np.uint64)
    return ReadPost(peer=AGENT, local_addrs=one, remote_addrs=one, nbytes=one,
                    mem_type="DRAM", notif=b"")


def _notice() -> M.Notice:
    return (AGENT, P.ReadNotice(request_id="r1", producer_engine_id="pre",
                                consumer_engine_id="dec", reads=1, nbytes=4096))


def _reply(instance: str = "inst-a", epoch: int = 1, held_s: float = 100.0,
           received_s: float = 1.0) -> Reply:
    return Reply(P.Acquired(epoch=epoch, held_s=held_s, hold_id=7), instance, received_s)


def _ack(instance: str = "inst-a", unknown: list[str] | None = None) -> Reply:
    return Reply(P.HeartbeatAck(unknown=unknown or []), instance, 0.0)


def _pull(nbytes: int = 4096) -> tuple[M.Pull, list[M.Action]]:
    """A pull with a cached handshake, assembled; the first actions after assembly."""
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1, 2], local_block_ids=[5, 6])
    pull = M.Pull(msg=msg, started_s=0.0, liveness_timeout_s=LIVENESS_S,
                  transfer_timeout_s=TIMEOUT_S)
    assert pull.begin(_remote()) == [M.SendAcquire(), M.Assemble()]
    acts = pull.assembled([_post(nbytes)], [_notice()], nbytes, 1, answered=False)
    return pull, acts


def _posted_running(pull: M.Pull, handle: int = 11) -> list[M.Action]:
    return pull.posted([PostResult(handle, False)], posted_s=0.5, post_s=0.0)


def _end(pull: M.Pull, acts: list[M.Action], now_s: float) -> M.Report:
    """Release (the only thing left) and return the one report."""
    assert acts[-1] == M.Release(), acts
    pull.handles = []  # released by the driver
    (report,) = pull.released(now_s)
    assert isinstance(report, M.Report)
    return report


PENDING = XferStatus(XferState.PENDING)
DONE = XferStatus(XferState.DONE)


def test_a_small_pull_posts_before_the_replies_and_ends_ok() -> None:
    pull, acts = _pull()
    assert acts == [M.Post((_post(),))] and pull.state is PullState.ACQUIRING
    assert pull.posted([PostResult(None, True)], 0.5, 0.0) == [M.AwaitReplies()]
    assert pull.state is PullState.READING
    acts = pull.on_replies([ADDR], [_reply()], now_s=1.0)
    assert pull.state is PullState.RELEASING and pull.outcome is Outcome.OK
    report = _end(pull, acts, 1.5)
    assert report.event.ok and report.notices == (_notice(),) and not report.abandon
    assert pull.state is PullState.DONE


def test_a_big_pull_waits_for_the_replies_before_posting() -> None:
    pull, acts = _pull(nbytes=M.EARLY_POST_MAX_BYTES + 1)
    assert acts == [M.AwaitReplies()]
    assert pull.on_replies([ADDR], [_reply()], 1.0) == [M.Post((_post(M.EARLY_POST_MAX_BYTES
                                                                       + 1),))]


def test_a_read_failing_under_a_restarted_producer_is_peer_lost() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    assert pull.on_replies([ADDR], [_reply()], 1.0) == [M.KeepLeases(), M.PollAfter(0.0)]
    err = TransferError("nixlRemoteDisconnectError")
    acts = pull.on_poll({11: XferStatus(XferState.FAILED, err)}, 1.1)
    assert acts == [M.Probe(ADDR, err, drop=(ADDR,))]
    acts = pull.handle(Probed(ADDR, _ack(instance="inst-b")), 1.15)
    assert pull.error.startswith("peer_lost") and "restarted" in pull.error
    assert pull.state is PullState.FAILING  # failed: never shown as reading any more
    report = _end(pull, acts, 1.2)  # the failed READ ended: nothing to quarantine
    assert not report.event.ok and report.event.invalid_block_ids == [5, 6]
    assert report.abandon == (ADDR,)  # it held the request for us


def test_a_probe_that_gets_no_answer_is_peer_lost_and_one_that_does_keeps_the_error() -> None:
    err = TransferError("boom")
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    pull.on_probed(err, {ADDR: None}, 1.1)
    assert pull.error.startswith("peer_lost") and "unreachable" in pull.error
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    pull.on_probed(err, {ADDR: _ack()}, 1.1)
    assert pull.error == f"transfer_failed: {err}"


def test_the_deadline_quarantines_a_running_read_and_severs_at_once() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    acts = pull.on_deadline(TIMEOUT_S)
    assert pull.state is PullState.QUARANTINED and pull.error.startswith("timeout")
    assert acts[0] == M.Quarantine(True, 4096)
    assert M.Sever({AGENT: (ADDR,)}) in acts  # past the deadline: at once
    assert isinstance(acts[-1], M.PollAfter)
    # still running: no report, no second sever
    acts = pull.on_poll({11: PENDING}, TIMEOUT_S + 1)
    assert not any(isinstance(a, (M.Sever, M.Release, M.Report)) for a in acts)
    # the transport ended it (severed): only now released and reported
    acts = pull.on_poll({11: XferStatus(XferState.FAILED, TransferError("severed"))},
                        TIMEOUT_S + 2)
    assert acts == [M.Quarantine(False, 4096), M.Release()]
    report = _end(pull, acts, TIMEOUT_S + 2)
    assert not report.event.ok and pull.state is PullState.FAILED


def test_a_producer_lost_mid_read_fails_within_one_poll_and_is_severed_then() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    acts = pull.on_poll({11: PENDING}, 2.0, unreachable=frozenset({ADDR}))
    assert pull.error.startswith("peer_lost") and pull.state is PullState.QUARANTINED
    assert M.Sever({AGENT: (ADDR,)}) not in acts  # the quarantine's first step ...
    acts = pull.on_poll({11: PENDING}, 2.01, unreachable=frozenset({ADDR}))
    assert M.Sever({AGENT: (ADDR,)}) in acts  # ... severs once liveness says it is lost


def test_a_quarantine_waits_the_liveness_timeout_before_severing_a_live_producer() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    acts = pull.fail("transfer_failed: x", 2.0)
    assert not any(isinstance(a, M.Sever) for a in acts)
    for t in (3.0, 7.0, 2.0 + LIVENESS_S - 0.01):
        assert not any(isinstance(a, M.Sever) for a in pull.on_poll({11: PENDING}, t))
    assert M.Sever({AGENT: (ADDR,)}) in pull.on_poll({11: PENDING}, 2.0 + LIVENESS_S)


def test_a_lost_lease_fails_the_pull_after_the_grace_while_the_read_is_pending() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    assert pull.renewing and pull.lease_addresses() == [ADDR]
    pull.on_lease_reply(ADDR, _ack(unknown=["r1"]), now_s=5.0)
    assert pull.lease_addresses() == []  # not renewed any more
    assert pull.on_poll({11: PENDING}, 5.0 + M.LOST_GRACE_S / 2) != []
    assert not pull.ending  # within the grace: its notice may be on its way
    pull.on_poll({11: PENDING}, 5.0 + 2 * M.LOST_GRACE_S)
    assert pull.error.startswith("peer_lost") and "no longer holds" in pull.error


def test_a_stale_handshake_discards_the_early_read_and_greets_again_twice_at_most() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    acts = pull.on_replies([ADDR], [_reply(instance="inst-b")], 1.0)
    assert acts == [M.KeepLeases(), M.PollAfter(0.0)] and pull.state is PullState.DISCARDING
    assert pull.on_poll({11: DONE}, 1.1) == [M.Discard()]  # the discarded READ ended
    acts = pull.discarded(1.2)
    assert acts == [M.ForgetHandshake(), M.WaitRanks()]
    assert pull.state is PullState.WAITING_RANKS and pull.handles == []
    assert pull.ranks_ready() == [M.Greet()]
    assert pull.greeted(_remote("inst-b")) == [M.SendAcquire(), M.Assemble()]
    pull.assembled([_post()], [_notice()], 4096, 1, answered=False)
    pull.posted([PostResult(None, True)], 1.5, 0.0)
    acts = pull.on_replies([ADDR], [_reply(instance="inst-c")], 2.0)  # again
    report = _end(pull, acts, 2.0)
    assert not report.event.ok and "keeps changing" in report.event.error


def test_a_read_that_may_predate_the_publish_is_read_again() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    # held 0.1 s when the Acquire came, 0.5 s after the READ was posted: too young
    acts = pull.on_replies([ADDR], [_reply(held_s=0.1, received_s=1.0)], 1.0)
    assert isinstance(acts[0], M.Warn) and acts[1:] == [M.KeepLeases(), M.PollAfter(0.0)]
    assert pull.renewing  # leases kept alive while the first READ ends
    assert pull.on_poll({11: DONE}, 1.1) == [M.Discard()]
    assert pull.discarded(1.1) == [M.Post((_post(),), again=True)]
    acts = pull.posted([PostResult(None, True)], 1.2, 0.0)
    report = _end(pull, acts, 1.3)
    assert report.event.ok


def test_a_refused_acquire_with_a_read_in_flight_is_quarantined_then_reported() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    acts = pull.on_replies([ADDR], [BlockIdError("blocks [1] were not published")], 1.0)
    assert pull.state is PullState.QUARANTINED and pull.acquired == []
    assert pull.on_poll({11: DONE}, 1.1) == [M.Quarantine(False, 4096), M.Release()]
    report = _end(pull, [M.Release()], 1.1)
    assert not report.event.ok and not report.abandon  # nobody holds it for us
    assert acts[0] == M.Quarantine(True, 4096)


def test_a_drain_ends_a_quarantine_at_once() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    pull.fail("transfer_failed: x", 2.0)
    pull.cancel_reason = DrainingError("daemon stopped")
    assert pull.on_poll({11: PENDING}, 2.1) == [M.Quarantine(False, 4096), M.Release()]


def test_a_cancelled_pull_releases_without_quarantine() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    acts = pull.cancel(DrainingError("daemon stopped"))
    assert acts == [M.Release()] and pull.outcome is Outcome.CANCELLED
    report = _end(pull, acts, 3.0)
    assert not report.event.ok and report.event.error.startswith("draining")


def test_an_assembly_failure_is_reported_once_the_replies_name_the_holders() -> None:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1], local_block_ids=[5])
    pull = M.Pull(msg=msg, started_s=0.0)
    pull.begin(_remote())
    assert pull.assembly_failed("incompatible: differ") == [M.AwaitReplies()]
    acts = pull.on_replies([ADDR], [_reply()], 1.0)
    report = _end(pull, acts, 1.0)
    assert report.event.error == "incompatible: differ" and report.abandon == (ADDR,)
    assert pull.state is PullState.FAILED


def test_exactly_one_report_whatever_happens_after_the_outcome() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    acts = pull.fail("transfer_failed: x", 2.0)
    assert pull.fail("later", 2.1) == [] and pull.on_deadline(TIMEOUT_S) == []
    assert pull.error == "transfer_failed: x"
    pull.on_poll({11: DONE}, 2.2)
    _end(pull, [M.Release()], 2.2)
    assert acts and pull.state is PullState.FAILED
    with pytest.raises(BadTransition):  # a second report cannot happen
        pull.released(2.3)


def test_a_local_pull_is_not_failed_by_a_stall_of_its_own_daemon() -> None:
    """Frozen with its daemon, a local pull's producer moved its leases on by the same gap:
    the stall rule that protects a remote pull would only fail it for nothing."""
    pull, _ = _pull()
    pull.path = Path.LOCAL
    _posted_running(pull)
    pull.on_replies([ADDR], [_reply()], 1.0)
    acts = pull.on_poll({11: DONE}, 1.0 + 10 * LIVENESS_S)
    assert acts == [M.Release()] and pull.outcome is Outcome.OK
    remote, _ = _pull()
    _posted_running(remote)
    remote.on_replies([ADDR], [_reply()], 1.0)
    remote.on_poll({11: DONE}, 1.0 + 10 * LIVENESS_S)
    assert remote.outcome is Outcome.FAILED and "stalled" in remote.error


# ------------------------------------------------------------------ one entry point


def test_the_driver_feeds_the_machine_through_handle_only() -> None:
    """Every decision is the machine's: the driver calls no step of it but `handle`
    (and reads its record and its lease query)."""
    from kvd.daemon.pull import driver as driver_mod

    src = inspect.getsource(driver_mod)
    steps = [name for name, _ in inspect.getmembers(M.Pull, inspect.isfunction)
             if not name.startswith("_") and name not in ("handle", "describe",
                                                          "lease_addresses")]
    called = [s for s in steps if f"pull.{s}(" in src]
    assert called == [] and "pull.handle(" in src


def test_a_failed_pull_is_never_shown_reading() -> None:
    pull, _ = _pull()
    _posted_running(pull)
    assert pull.state is PullState.READING
    pull.handle(RepliesIn([ADDR], [_reply()]), 1.0)
    pull.handle(Polled({11: XferStatus(XferState.FAILED, TransferError("x"))}), 1.1)
    assert pull.state is PullState.READING  # probing: not failed yet
    pull.handle(Probed(ADDR, None), 1.2)
    assert pull.ending and pull.state is PullState.FAILING
    pull.handles = []
    pull.handle(Released(), 1.3)
    assert pull.state is PullState.FAILED


def test_an_engine_registered_again_fails_the_pull_in_the_machine() -> None:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1], local_block_ids=[5])
    pull = M.Pull(msg=msg, started_s=0.0)
    assert pull.handle(Begin(None), 0.0) == [M.WaitRanks()]
    assert pull.handle(RanksReady(again=True), 0.1) == [M.Release()]
    assert "registered again" in pull.error and pull.state is PullState.FAILING


def test_a_cached_handshake_without_a_mover_greets_afresh_and_a_retired_one_once_more(
        ) -> None:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1], local_block_ids=[5])
    pull = M.Pull(msg=msg, started_s=0.0)
    assert pull.handle(Begin(_remote(), path=None), 0.0) == [M.WaitRanks()]
    pull.handle(RanksReady(), 0.1)
    assert pull.handle(Greeted(_remote(), None), 0.2) == [M.ForgetHandshake(), M.Greet()]
    assert pull.state is PullState.HANDSHAKING
    assert pull.handle(Greeted(_remote(), None), 0.3) == [M.Release()]
    assert "keep being freed" in pull.error
    pull = M.Pull(msg=msg, started_s=0.0)
    pull.handle(Begin(None), 0.0)
    pull.handle(RanksReady(), 0.1)
    assert pull.handle(Greeted(_remote(), Path.HOST), 0.2) == [M.SendAcquire(), M.Assemble()]
    assert pull.path is Path.HOST


def test_the_machine_tells_a_deadline_from_a_drain() -> None:
    pull, _ = _pull()
    pull.handle(Interrupted(deadline=True), TIMEOUT_S)
    assert pull.timed_out and pull.error.startswith("timeout")
    pull, _ = _pull()
    pull.cancel_reason = DrainingError("daemon stopped")
    pull.handle(Interrupted(deadline=True), TIMEOUT_S)  # both: the drain's reason wins
    assert pull.outcome is Outcome.CANCELLED and pull.error.startswith("draining")


def test_probes_go_one_daemon_at_a_time_up_to_the_first_lost_one() -> None:
    second = "tcp://p:2"
    remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type]
        ADDR: RemoteDaemon(ADDR, agent=AGENT, instance="inst-a", epoch=1),
        second: RemoteDaemon(second, agent="agent-q", instance="inst-q", epoch=1)})
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1], local_block_ids=[5])
    pull = M.Pull(msg=msg, started_s=0.0)
    pull.handle(Begin(remote, Path.REMOTE), 0.0)
    pull.assembled([_post()], [_notice()], 4096, 1, answered=False)
    _posted_running(pull)
    pull.handle(RepliesIn([ADDR, second], [_reply(), _reply("inst-q")]), 1.0)
    err = TransferError("boom")
    acts = pull.handle(Polled({11: XferStatus(XferState.FAILED, err)}), 1.1)
    assert acts == [M.Probe(ADDR, err, drop=(ADDR, second))]
    assert pull.handle(Probed(ADDR, _ack()), 1.2) == [M.Probe(second, err)]
    pull.handle(Probed(second, _ack(instance="inst-r")), 1.3)
    assert pull.error.startswith("peer_lost") and second in pull.error

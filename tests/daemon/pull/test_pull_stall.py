"""A pull whose own daemon stalled (frozen, a stuck loop) longer than the liveness timeout
during its read phase fails: no heartbeat renewed the producers' leases meanwhile, so a
hold may have ended under its READ and its blocks been reused (found by the fleet
simulation, tests/daemon/test_fleet_sim.py). Driven by hand, as
tests/daemon/pull/test_pull_machine.py does."""

from __future__ import annotations

import numpy as np

from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull import machine as M
from kvd.daemon.pull.state import PullState
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from kvd.wire import protocol as P

ADDR, AGENT, LIVENESS_S = "tcp://p:1", "agent-p", 3.0
PENDING, DONE = XferStatus(XferState.PENDING), XferStatus(XferState.DONE)


def _pull() -> M.Pull:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1], local_block_ids=[5])
    pull = M.Pull(msg=msg, started_s=0.0, liveness_timeout_s=LIVENESS_S)
    remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type]
        ADDR: RemoteDaemon(ADDR, agent=AGENT, instance="i", epoch=1)})
    pull.begin(remote)
    one = np.array([4096], dtype=np.uint64)
    post = ReadPost(peer=AGENT, local_addrs=one, remote_addrs=one, nbytes=one,
                    mem_type="DRAM", notif=b"")
    notice = (AGENT, P.ReadNotice(request_id="r1", producer_engine_id="pre",
                                  consumer_engine_id="dec", reads=1))
    assert pull.assembled([post], [notice], 4096, 1, answered=False) == [M.Post((post,))]
    return pull


def _reply(received_s: float) -> Reply:
    return Reply(P.Acquired(epoch=1, held_s=100.0), "i", received_s)


def _released(pull: M.Pull, acts: list[M.Action], now_s: float) -> P.Event:
    assert acts[-1] == M.Release(), acts
    pull.handles = []
    (report,) = pull.released(now_s)
    assert isinstance(report, M.Report)
    return report.event


def test_polls_a_stall_apart_fail_the_pull_even_when_the_read_ended() -> None:
    pull = _pull()
    pull.posted([PostResult(11, False)], posted_s=1.0, post_s=0.0)
    assert pull.on_replies([ADDR], [_reply(1.001)], 1.001) == [M.KeepLeases(), M.PollAfter(0.0)]
    pull.on_poll({11: PENDING}, 1.002)
    acts = pull.on_poll({11: DONE}, 1.002 + LIVENESS_S + 0.5)  # frozen in between
    event = _released(pull, acts, 5.0)
    assert not event.ok and "stalled" in event.error and event.error.startswith("peer_lost")


def test_a_reply_taken_a_stall_after_the_early_read_fails_the_pull() -> None:
    pull = _pull()
    pull.posted([PostResult(None, True)], posted_s=1.0, post_s=0.0)
    acts = pull.on_replies([ADDR], [_reply(1.0 + LIVENESS_S + 1)], 1.0 + LIVENESS_S + 1)
    assert not _released(pull, acts, 6.0).ok


def test_a_stall_during_a_read_again_fails_once_the_discard_ended() -> None:
    pull = _pull()
    pull.posted([PostResult(11, False)], posted_s=1.0, post_s=0.0)
    acts = pull.on_replies([ADDR], [Reply(P.Acquired(epoch=1, held_s=0.0), "i", 1.5)], 1.5)
    assert acts[-1] == M.PollAfter(0.0) and pull.state is PullState.DISCARDING
    assert pull.on_poll({11: PENDING}, 1.5 + LIVENESS_S + 1) != []  # the discard goes on
    assert pull.on_poll({11: DONE}, 5.6) == [M.Discard()]
    acts = pull.discarded(5.6)  # not read again: failed
    assert not _released(pull, acts, 5.6).ok and pull.state is PullState.FAILED


def test_steps_within_the_liveness_timeout_end_ok() -> None:
    pull = _pull()
    pull.posted([PostResult(11, False)], posted_s=1.0, post_s=0.0)
    pull.on_replies([ADDR], [_reply(1.0 + LIVENESS_S - 0.1)], 1.0 + LIVENESS_S - 0.1)
    acts = pull.on_poll({11: DONE}, 2.0 * LIVENESS_S - 0.3)
    assert _released(pull, acts, 6.0).ok


def test_a_reply_taken_a_stall_after_the_acquire_fails_a_pull_that_waits_to_post() -> None:
    """A large pull posts only once the replies are in: its Acquire's time is the start."""
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDR, remote_block_ids=[1], local_block_ids=[5])
    pull = M.Pull(msg=msg, started_s=0.0, liveness_timeout_s=LIVENESS_S)
    pull.begin(RemoteEngine(desc=None, daemons={  # type: ignore[arg-type]
        ADDR: RemoteDaemon(ADDR, agent=AGENT, instance="i", epoch=1)}))
    pull.acquire_sent(1.0)
    big = np.array([M.EARLY_POST_MAX_BYTES + 1], dtype=np.uint64)
    post = ReadPost(peer=AGENT, local_addrs=big, remote_addrs=big, nbytes=big,
                    mem_type="DRAM", notif=b"")
    assert pull.assembled([post], [], int(big[0]), 1, answered=False) == [M.AwaitReplies()]
    acts = pull.on_replies([ADDR], [_reply(1.0 + LIVENESS_S + 1)], 1.0 + LIVENESS_S + 1)
    assert not _released(pull, acts, 6.0).ok  # nothing posted: failed at once
    on_time = _pull()
    on_time.acquire_sent(1.0)
    assert on_time.on_replies([ADDR], [_reply(2.0)], 2.0) == [M.Post(on_time.posts)]

"""A host-path copy is ok only if its producer's incarnation outlived it, and a failing
pull's quarantine counts from the clock's time, never from zero.

A copy out of another daemon's mapped pool files never fails by itself: when that
daemon dies and a successor adopts its pools, the producer engine may reuse the blocks
under the copy. So once every copy ended the pull asks (`Confirm`) whether the owner of
those files is still alive (its owner lock, `kvd.pool.owner.OwnerWatch`), and fails
``peer_lost`` otherwise. Driven by hand on plain numbers for time, and on real files and
locks for the watch itself.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull import machine as M
from kvd.daemon.pull.state import PullState
from kvd.errors import TransferError
from kvd.pool.owner import OwnerWatch, PoolOwner, owner_lock_name
from kvd.transport.base import PostResult, ReadPost, XferState, XferStatus
from kvd.wire import protocol as P

A, B = "tcp://p:1", "tcp://p:2"
FAR_S = 1_000_000.0  # a monotonic clock of a host up for eleven days
LIVENESS_S = 3.0


def _post(agent: str) -> ReadPost:
    one = np.array([4096], dtype=np.uint64)
    return ReadPost(peer=agent, local_addrs=one, remote_addrs=one, nbytes=one,
                    mem_type="DRAM", notif=b"")


def _pull(path: str, addrs: tuple[str, ...] = (A,), now_s: float = 0.0) -> M.Pull:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=A, remote_block_ids=[1, 2], local_block_ids=[5, 6])
    pull = M.Pull(msg=msg, started_s=now_s, path=path, liveness_timeout_s=LIVENESS_S)
    remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type] - unused here
        a: RemoteDaemon(a, agent=f"agent-{a}", instance="i", epoch=1) for a in addrs})
    pull.begin(remote)
    notices = [(f"agent-{a}", P.ReadNotice(request_id="r1", producer_engine_id="pre",
                                           consumer_engine_id="dec", reads=1))
               for a in addrs]
    pull.assembled([_post(f"agent-{a}") for a in addrs], notices, 4096 * len(addrs),
                   len(addrs), answered=False)
    return pull


def _reply(now_s: float) -> Reply:
    return Reply(P.Acquired(epoch=1, held_s=100.0), "i", now_s)


def _report(pull: M.Pull, acts: list[M.Action], now_s: float) -> P.Event:
    assert acts == [M.Release()], acts
    pull.handles = []
    (report,) = pull.released(now_s)
    assert isinstance(report, M.Report)
    return report.event


def test_a_host_copy_asks_whether_its_producer_outlived_it_before_it_is_ok() -> None:
    pull = _pull("host")
    assert pull.posted([PostResult(None, True)], 0.5, 0.0) == [M.AwaitReplies()]
    assert pull.on_replies([A], [_reply(1.0)], 1.0) == [M.Confirm()]
    event = _report(pull, pull.confirmed("", 1.0), 1.0)
    assert event.ok and pull.state is PullState.DONE


def test_a_host_copy_whose_producer_died_meanwhile_fails_with_every_block_invalid() -> None:
    pull = _pull("host")
    pull.posted([PostResult(11, False)], 0.5, 0.0)
    assert pull.on_replies([A], [_reply(1.0)], 1.0) == [M.KeepLeases(), M.PollAfter(0.0)]
    acts = pull.on_poll({11: XferStatus(XferState.DONE)}, 1.2)
    assert acts == [M.Confirm()]  # the copy ended: it would have been ok without asking
    event = _report(pull, pull.confirmed("the producer daemon died", 1.2), 1.3)
    assert not event.ok and event.error.startswith("peer_lost")
    assert event.invalid_block_ids == [5, 6]


@pytest.mark.parametrize("path", ["remote", "local"])
def test_paths_whose_reads_fail_by_themselves_do_not_ask(path: str) -> None:
    pull = _pull(path)
    pull.posted([PostResult(None, True)], 0.5, 0.0)
    assert _report(pull, pull.on_replies([A], [_reply(1.0)], 1.0), 1.0).ok


def test_a_quarantine_on_a_clock_far_from_zero_waits_before_severing() -> None:
    """Two producers; the READ from one fails while the other's runs. The quarantine
    counts from the failure: nobody is severed before the liveness timeout, and the
    warning comes once per QUARANTINE_LOG_S, not on every poll."""
    now = FAR_S
    pull = _pull("remote", (A, B), now)
    pull.posted([PostResult(11, False), PostResult(12, False)], now + 0.1, 0.0)
    pull.on_replies([A, B], [_reply(now + 0.2), _reply(now + 0.2)], now + 0.2)
    err = TransferError("nixlRemoteDisconnectError")
    acts = pull.on_poll({11: XferStatus(XferState.FAILED, err),
                         12: XferStatus(XferState.PENDING)}, now + 0.3)
    assert acts == [M.Probe(A, err, drop=(A, B))]
    ack = Reply(P.HeartbeatAck(unknown=[]), "i", now + 0.4)
    acts = pull.on_probed(err, {A: ack, B: ack}, now + 0.4)
    assert pull.state is PullState.QUARANTINED
    assert not [a for a in acts if isinstance(a, (M.Sever, M.Warn))], acts
    warned = severed = 0
    t = now + 0.4
    while t < now + 0.4 + LIVENESS_S - 0.1:
        t += 0.05
        acts = pull.on_poll({12: XferStatus(XferState.PENDING)}, t)
        warned += sum(isinstance(a, M.Warn) for a in acts)
        severed += sum(isinstance(a, M.Sever) for a in acts)
    assert (warned, severed) == (0, 0)
    acts = pull.on_poll({12: XferStatus(XferState.PENDING)}, now + 0.4 + LIVENESS_S + 0.01)
    assert [a for a in acts if isinstance(a, M.Sever)] == [M.Sever({"agent-" + B: (B,)})]


# ------------------------------------------------------------------ the owner watch


def test_the_owner_lock_is_named_after_the_pool_file() -> None:
    assert owner_lock_name("kvd-12-0a1b2c3d-00112233aabb") == "kvd-12-0a1b2c3d.lock"
    assert owner_lock_name("my-kvd-x-7-deadbeef-00112233aabb") == "my-kvd-x-7-deadbeef.lock"
    assert owner_lock_name("kvd-pool-without-owner") is None


def test_the_watch_says_alive_while_the_owner_holds_its_lock_and_never_blocks_it(
        tmp_path: Path) -> None:
    owner = PoolOwner.acquire(tmp_path, "kvdw")
    pool = tmp_path / owner.pool_name()
    pool.write_bytes(b"\0" * 4096)
    name = owner_lock_name(pool.name)
    assert name is not None and tmp_path / name == owner.lock_path
    watch = OwnerWatch(tmp_path / name)
    try:
        assert watch.alive() and watch.alive()
        # A successor's checks (shared) and the reaper's (exclusive, on its own
        # descriptor) are not disturbed by a probe between them.
        fd = os.open(owner.lock_path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        os.close(owner.fd)  # the owner dies (kill -9 drops its flock; the file stays)
        owner.fd = None
        assert not watch.alive()
        fd = os.open(owner.lock_path, os.O_RDONLY)  # the probe left no lock behind
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        watch.close()

"""Judging an Acquire's replies without waiting, for a pull reported in the engine's
request itself: `Acquiring.ready` hands them over only when every reply is in, and the
pull (kvd.daemon.pull.machine) reports ok only when none is an error and each names the
cached incarnation and epoch; a refusal fails the pull (its holder is told to abandon),
a stale reply makes it greet again."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.acquiring import Acquiring
from kvd.daemon.pull.machine import ForgetHandshake, Pull, Release, Report, WaitRanks
from kvd.daemon.pull.state import PullState
from kvd.errors import BlockIdError
from kvd.transport.base import PostResult, ReadPost
from kvd.wire import protocol as P

ADDRS = ("tcp://p:1", "tcp://p:2")


def _pull() -> Pull:
    """A small pull whose READ was posted before the replies, and is done already."""
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDRS[0], remote_block_ids=[1], local_block_ids=[2])
    remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type] - unused here
        a: RemoteDaemon(a, agent=f"agent-{i}", instance=f"inst-{i}", epoch=3)
        for i, a in enumerate(ADDRS)})
    pull = Pull(msg=msg, started_s=0.0)
    pull.begin(remote)
    one = np.array([4096], dtype=np.uint64)
    post = ReadPost(peer="agent-0", local_addrs=one, remote_addrs=one, nbytes=one,
                    mem_type="DRAM", notif=b"")
    assert pull.assembled([post], [], 4096, 1, answered=False)[0].posts == (post,)
    assert pull.posted([PostResult(None, True)], posted_s=0.5, post_s=0.0) != []
    return pull


def _reply(i: int, epoch: int = 3, instance: str = "") -> Reply:
    return Reply(P.Acquired(epoch=epoch, held_s=1.0, hold_id=7),
                 instance or f"inst-{i}", received_s=1.0)


@pytest.mark.parametrize("case", ["both", "one_missing", "one_refused", "stale_epoch",
                                  "restarted"])
def test_replies_judged_now_only_when_every_one_is_in(case: str) -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        futs = {a: loop.create_future() for a in ADDRS}
        futs[ADDRS[0]].set_result(_reply(0))
        if case == "both":
            futs[ADDRS[1]].set_result(_reply(1))
        elif case == "one_refused":
            futs[ADDRS[1]].set_exception(BlockIdError("blocks [1] were not published"))
        elif case == "stale_epoch":
            futs[ADDRS[1]].set_result(_reply(1, epoch=4))
        elif case == "restarted":
            futs[ADDRS[1]].set_result(_reply(1, instance="inst-new"))
        taken: list[int] = []
        acq = Acquiring(futs, lambda _: taken.append(1))
        pull = _pull()
        got = acq.ready()
        if case == "one_missing":
            assert got is None  # not judged here: the task waits for it
            assert taken == [1]  # replies already queued were looked for first
            futs[ADDRS[1]].set_result(_reply(1))
            got = await acq.wait()
        assert got is not None
        acts = pull.on_replies(acq.addresses, got, now_s=1.0)
        if case in ("both", "one_missing"):
            assert acts == [Release()] and pull.acquired == list(ADDRS)
            (report,) = pull.released(now_s=1.0)
            assert isinstance(report, Report) and report.event.ok
            assert pull.state is PullState.DONE
        elif case in ("stale_epoch", "restarted"):
            # judged: the pull starts over (handshake again), nothing reported
            assert acts == [ForgetHandshake(), WaitRanks()]
            assert pull.state is PullState.WAITING_RANKS and not pull.ending
        else:  # the refusal fails the pull; the daemon holding it is told to abandon
            assert acts == [Release()] and pull.error.startswith("bad_block_ids")
            assert pull.acquired == [ADDRS[0]]
            (report,) = pull.released(now_s=1.0)
            assert isinstance(report, Report) and not report.event.ok
            assert report.abandon == (ADDRS[0],) and report.event.invalid_block_ids == [2]

    asyncio.run(body())

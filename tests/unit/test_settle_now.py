"""`Acquiring.settle_now`: judging an Acquire's replies without waiting, for a pull
reported in the engine's request itself (issue 23.4). It may only say True when every
reply is in, none is an error, and each names the cached incarnation and epoch; in every
other case the pull's task must judge (and report) as before."""

from __future__ import annotations

import asyncio

import pytest

from kvd.daemon import pull_reads
from kvd.daemon.peerconn import Reply
from kvd.daemon.peers import RemoteDaemon, RemoteEngine
from kvd.errors import BlockIdError
from kvd.wire import protocol as P

ADDRS = ("tcp://p:1", "tcp://p:2")


def _acquiring(futs: dict[str, asyncio.Future[Reply]], taken: list[int]
               ) -> pull_reads.Acquiring:
    msg = P.Pull(engine_id="dec", request_id="r1", remote_engine_id="pre",
                 remote_address=ADDRS[0], remote_block_ids=[1], local_block_ids=[2])
    job = pull_reads.PullJob(msg=msg, started_s=0.0)
    remote = RemoteEngine(desc=None, daemons={  # type: ignore[arg-type] - unused here
        a: RemoteDaemon(a, agent=f"agent-{i}", instance=f"inst-{i}", epoch=3)
        for i, a in enumerate(ADDRS)})
    return pull_reads.Acquiring(job, remote, futs, lambda _: taken.append(1))


def _reply(i: int, epoch: int = 3, instance: str = "") -> Reply:
    return Reply(P.Acquired(epoch=epoch, held_s=1.0, hold_id=7),
                 instance or f"inst-{i}", received_s=1.0)


@pytest.mark.parametrize("case", ["both", "one_missing", "one_refused", "stale_epoch",
                                  "restarted"])
def test_settle_now_is_true_only_for_every_good_reply(case: str) -> None:
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
        acq = _acquiring(futs, taken)
        got = acq.settle_now()
        if case == "both":
            assert got is True and acq.settled and acq.job.acquired == list(ADDRS)
        elif case in ("stale_epoch", "restarted"):
            assert got is False  # judged: the task starts over (handshake again)
            assert acq.settled
        else:  # not judged here: the task's settle waits, or raises the refusal
            assert got is None and not acq.settled
            if case == "one_missing":
                assert taken == [1]  # replies already queued were looked for first
                futs[ADDRS[1]].set_result(_reply(1))
                assert await acq.settle() is True
            else:
                with pytest.raises(BlockIdError):
                    await acq.settle()
                assert acq.job.acquired == [ADDRS[0]]  # the one holding it is abandoned

    asyncio.run(body())

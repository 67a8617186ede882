"""A pull's record (`PullJob`, `PullState`) and its Acquire in flight (`Acquiring`).

Split from kvd.daemon.pull_reads (the READ phase) and kvd.daemon.quarantine (the end
of a failing pull's READs), which both work on these.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvd.daemon.engines import Engine, EngineRank
from kvd.daemon.peerconn import Reply
from kvd.daemon.peers import RemoteEngine
from kvd.daemon.services import Services
from kvd.errors import KvdError, PeerLostError
from kvd.wire import protocol as P


class PullState(enum.Enum):
    QUEUED = "queued"
    WAITING_RANKS = "waiting_ranks"
    HANDSHAKING = "handshaking"
    ACQUIRING = "acquiring"
    READING = "reading"
    QUARANTINED = "quarantined"  # failed, but a READ may still land: not reported yet
    DONE = "done"
    FAILED = "failed"


@dataclass
class PullJob:
    msg: P.Pull
    started_s: float
    state: PullState = PullState.QUEUED
    nbytes: int = 0
    descriptors: int = 0
    xfers: list[int] = field(default_factory=list)
    live: set[int] = field(default_factory=set)  # posted, not yet ended by the transport
    pinned: list[EngineRank] = field(default_factory=list)
    acquired: list[str] = field(default_factory=list)  # producer daemons holding it for us
    remote: RemoteEngine | None = None
    reading_from: dict[int, str] = field(default_factory=dict)  # pending xfer -> agent
    lost: dict[str, tuple[float, PeerLostError]] = field(default_factory=dict)  # by agent
    cancel_reason: KvdError | None = None  # why the daemon cancelled the task
    timed_out: bool = False  # past transfer_timeout_s: the deadline cancelled the task
    task: asyncio.Task[None] | None = None
    early: Acquiring | None = None  # the Acquire sent when the Pull came (cached handshake)
    reply_to: tuple[bytes, int] | None = None  # (identity, request id): answer when done
    notices: list[Callable[[], None]] = field(default_factory=list)  # sent once reported
    # per post: (seconds, descriptors, PostTiming per READ), for the metrics once reported
    posted: list[tuple[float, int, list[Any]]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.msg.engine_id, self.msg.request_id)


class Acquiring:
    """A pull's Acquire, on its way to every producer daemon while the pull goes on.

    Sent before the descriptors are assembled; the READs are posted without waiting
    for the replies when they have not come yet (issue 12.4: one control round trip
    on the request path, overlapped with the READ). Nothing read is trusted, and no
    READ notice sent, before `settle` has every reply: a refused Acquire fails the pull
    (its blocks reported invalid), a stale handshake makes it start over, and a hold
    younger than the time from posting to the reply (the READ may predate the publish)
    makes it read again.
    """

    def __init__(self, job: PullJob, remote: RemoteEngine,
                 replies: dict[str, asyncio.Future[Reply]],
                 take_ready: Callable[[Iterable[str]], None] = lambda _: None) -> None:
        self.job = job
        self.remote = remote
        self._futures = replies  # by producer daemon address
        self._take_ready = take_ready  # handles replies already queued, without a loop turn
        self._replies: dict[str, Reply] | None = None
        self._error: BaseException | None = None

    @classmethod
    def send(cls, svc: Services, job: PullJob, engine: Engine,
             remote: RemoteEngine) -> Acquiring:
        msg = job.msg
        acquire = P.Acquire(request_id=msg.producer_request_id,
                            producer_engine_id=msg.remote_engine_id,
                            consumer_engine_id=msg.engine_id,
                            block_ids=list(msg.remote_block_ids),
                            consumer_tp_size=engine.par.tp_size,
                            consumer_pp_size=engine.par.pp_size,
                            consumer_layer_partition=(list(engine.par.layer_partition)
                                                      if engine.par.layer_partition else None))
        return cls(job, remote, {a: svc.peers.send(a, acquire) for a in remote.daemons},
                   svc.peers.take_ready)

    async def forget(self) -> None:
        """An Acquire superseded by another one of the same pull: only its replies are
        collected (the producer holds the request for this consumer either way)."""
        await asyncio.gather(*self._futures.values(), return_exceptions=True)

    @property
    def answered(self) -> bool:
        return self._replies is not None or all(f.done() for f in self._futures.values())

    @property
    def settled(self) -> bool:
        return self._replies is not None

    async def settle(self) -> bool:
        """Every reply, or the first error raised (after noting in ``job.acquired`` who
        holds the request for us). True when each came from the daemon incarnation and
        engine epoch of the cached handshake: False, the addresses we know may be stale."""
        if self._error is not None:
            raise self._error
        if self._replies is None:
            addrs = list(self._futures)
            if not all(f.done() for f in self._futures.values()):
                self._take_ready(addrs)  # a reply that came while we posted: no loop turn
            got: list[Reply | BaseException] = []
            for fut in self._futures.values():  # no gather: no extra loop turn
                try:
                    got.append(await fut)
                except Exception as exc:  # noqa: BLE001 - every reply is looked at first
                    got.append(exc)
            self._collect(addrs, got)
        return self._current()

    def settle_now(self) -> bool | None:
        """`settle` without waiting: None when some reply has not come yet (those already
        queued are taken first) or when one is an error (`settle` then raises it, with
        its bookkeeping, on the pull's task); else what `settle` returns."""
        if self._error is not None:
            return None
        if self._replies is None:
            if not all(f.done() for f in self._futures.values()):
                self._take_ready(list(self._futures))
            futs = self._futures.values()
            if not all(f.done() and not f.cancelled() and f.exception() is None
                       for f in futs):
                return None
            self._collect(list(self._futures), [f.result() for f in futs])
        return self._current()

    def _collect(self, addrs: list[str], got: list[Reply | BaseException]) -> None:
        self.job.acquired = [a for a, r in zip(addrs, got, strict=True)
                             if not isinstance(r, BaseException)]
        for r in got:
            if isinstance(r, BaseException):
                self._error = r
                raise r
        self._replies = dict(zip(addrs, got, strict=True))  # type: ignore[arg-type]

    def _current(self) -> bool:
        assert self._replies is not None
        daemons = self.remote.daemons
        return all(r.instance == daemons[a].instance and r.body.epoch == daemons[a].epoch
                   for a, r in self._replies.items())

    def receipted(self, agent: str) -> bool:
        """Whether the pull's publish receipt names the cached incarnation of every daemon
        behind ``agent``: then the publish happened before the Pull was sent, and a READ
        from it may go out before the Acquire's reply whatever its size."""
        receipt = self.job.msg.publish_receipt
        behind = [d for d in self.remote.daemons.values() if d.agent == agent]
        return bool(receipt and behind) and all(receipt.startswith(d.instance + "/")
                                                for d in behind)

    def may_predate_publish(self, agent: str, posted_s: float) -> bool:
        """Whether a READ from ``agent`` posted at ``posted_s`` (before its daemon's reply
        came) may have run before the request was published there. Not if the reply names
        the hold of the pull's publish receipt: that hold existed before the Pull was
        sent, and lasted until the Acquire joined it. Otherwise the producer held it for
        ``held_s`` when the Acquire arrived, at most ``received_s - posted_s`` after the
        post; a hold older than that began before the READ."""
        assert self._replies is not None
        receipt = self.job.msg.publish_receipt
        for a, d in self.remote.daemons.items():
            r = self._replies[a]
            if d.agent != agent or (receipt and P.receipt(r.instance, r.body.hold_id)
                                    == receipt):
                continue
            if r.body.held_s < r.received_s - posted_s:
                return True
        return False

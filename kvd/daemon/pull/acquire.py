"""A pull's Acquire: the pure rules that judge its replies, and its futures in flight.

The Acquire leaves before the descriptors are assembled, and small READs are posted
without waiting for its replies (one control round trip on the request path,
overlapped with the READ). Nothing read is trusted, and no READ notice sent, before
every reply is in and judged (`judge`): a refused Acquire fails the pull (its blocks
reported invalid), replies from another incarnation or engine epoch than the cached
handshake make it greet again, and a hold younger than the time from posting to the
reply (the READ may predate the publish) makes it read again.

`Replies` and the functions below are pure; `Acquiring` holds the futures of the
requests on the wire and hands their replies, once all are in, to the pull
(kvd.daemon.pull.machine) through its driver.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvd.daemon.peers.conn import Reply
from kvd.daemon.peers.table import RemoteDaemon
from kvd.wire import protocol as P


@dataclass(frozen=True)
class Replies:
    """Every producer daemon's reply to one Acquire, by daemon address."""

    by_address: Mapping[str, Reply]

    def current(self, daemons: Mapping[str, RemoteDaemon]) -> bool:
        """Whether each came from the daemon incarnation and engine epoch of the cached
        handshake: False, the addresses we know may be stale."""
        return all(r.instance == daemons[a].instance and r.body.epoch == daemons[a].epoch
                   for a, r in self.by_address.items())


def receipted(msg: P.Pull, daemons: Mapping[str, RemoteDaemon], agent: str) -> bool:
    """Whether the pull's publish receipt names the cached incarnation of every daemon
    behind ``agent``: then the publish happened before the Pull was sent, and a READ from
    it may go out before the Acquire's reply whatever its size."""
    receipt = msg.publish_receipt
    behind = [d for d in daemons.values() if d.agent == agent]
    return bool(receipt and behind) and all(receipt.startswith(d.instance + "/")
                                            for d in behind)


def may_predate_publish(msg: P.Pull, daemons: Mapping[str, RemoteDaemon], replies: Replies,
                        agent: str, posted_s: float) -> bool:
    """Whether a READ from ``agent`` posted at ``posted_s`` (before its daemon's reply came)
    may have run before the request was published there. Not if the reply names the hold
    of the pull's publish receipt: that hold existed before the Pull was sent, and lasted
    until the Acquire joined it. Otherwise the producer held it for ``held_s`` when the
    Acquire arrived, at most ``received_s - posted_s`` after the post; a hold older than
    that began before the READ."""
    receipt = msg.publish_receipt
    for a, d in daemons.items():
        r = replies.by_address[a]
        if d.agent != agent or (receipt and P.receipt(r.instance, r.body.hold_id) == receipt):
            continue
        if r.body.held_s < r.received_s - posted_s:
            return True
    return False


class Acquiring:
    """The Acquire's requests on the wire, one future per producer daemon address.

    ``take_ready`` handles replies already queued on the sockets without a loop turn."""

    def __init__(self, futures: dict[str, asyncio.Future[Reply]],
                 take_ready: Callable[[Iterable[str]], None] = lambda _: None) -> None:
        self._futures = futures
        self._take_ready = take_ready

    @staticmethod
    def acquire_msg(msg: P.Pull, tp_size: int, pp_size: int,
                    layer_partition: tuple[int, ...] | None) -> P.Acquire:
        return P.Acquire(request_id=msg.producer_request_id,
                         producer_engine_id=msg.remote_engine_id,
                         consumer_engine_id=msg.engine_id, block_ids=list(msg.remote_block_ids),
                         consumer_tp_size=tp_size, consumer_pp_size=pp_size,
                         consumer_layer_partition=(list(layer_partition)
                                                   if layer_partition else None))

    @property
    def answered(self) -> bool:
        return all(f.done() for f in self._futures.values())

    def ready(self) -> list[Reply | BaseException] | None:
        """Every reply or error, now, without waiting (replies already queued are taken
        first); None while one is still out."""
        if not self.answered:
            self._take_ready(list(self._futures))
        if not self.answered:
            return None
        return [_outcome(f) for f in self._futures.values()]

    async def wait(self) -> list[Reply | BaseException]:
        """Every reply or error, in address order (no gather: no extra loop turn)."""
        if not self.answered:
            self._take_ready(list(self._futures))
        got: list[Reply | BaseException] = []
        for fut in self._futures.values():
            try:
                got.append(await fut)
            except Exception as exc:  # noqa: BLE001 - every reply is looked at first
                got.append(exc)
        return got

    @property
    def addresses(self) -> list[str]:
        return list(self._futures)

    async def forget(self) -> None:
        """An Acquire superseded by another one of the same pull: only its replies are
        collected (the producer holds the request for this consumer either way)."""
        await asyncio.gather(*self._futures.values(), return_exceptions=True)


def _outcome(fut: asyncio.Future[Reply]) -> Reply | BaseException:
    if fut.cancelled():
        return asyncio.CancelledError()
    exc = fut.exception()
    return exc if exc is not None else fut.result()

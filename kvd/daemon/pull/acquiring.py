"""A pull's Acquire on the wire: one future per producer daemon, handed to the pull
(kvd.daemon.pull.machine) through its driver once every reply is in (the rules that
judge them: kvd.daemon.pull.acquire)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from kvd.daemon.peers.reply import Reply
from kvd.wire import protocol as P


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

"""All NIXL calls on one dedicated thread, awaited from the event loop.

NIXL agents are not thread-safe in their default sync mode, and `transfer()`
can copy a whole request inline; one worker thread serializes the agent and
keeps the event loop free. Each coroutine here is one hop to that thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvd.errors import TransferError
from kvd.transport.base import ReadPost, Transport, TransportCounts

T = TypeVar("T")


def new_nixl_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-nixl")


class DataPath:
    def __init__(self, transport: Transport, executor: ThreadPoolExecutor | None = None) -> None:
        self.transport = transport
        self._pool = executor or new_nixl_executor()
        self._metadata: dict[str, bytes] = {}  # peer agent -> metadata loaded
        self._gates: dict[str, asyncio.Event] = {}  # closed while a peer is reloaded
        self._inflight: dict[str, int] = {}  # peer agent -> transfer handles not released
        self._xfer_peer: dict[int, str] = {}

    @property
    def agent_name(self) -> str:
        return self.transport.name

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def metadata(self) -> bytes:
        return await self.call(self.transport.metadata)

    async def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        return await self.call(self.transport.register, addr, nbytes, mem_type, device_id)

    async def deregister(self, reg_id: int) -> None:
        await self.call(self.transport.deregister, reg_id)

    async def load_peer(self, metadata: bytes, agent_name: str,
                        drain_timeout_s: float = 10.0) -> str:
        """Load a peer's metadata, replacing what we knew of it.

        NIXL keeps a peer's old memory sections when metadata is loaded again, and a
        section the peer has since deregistered (its pool freed, the address reused by
        a new pool) makes a later READ fail with NOT_FOUND. So a changed peer is
        removed and loaded afresh, but only once no READ to it is in flight: new posts
        to it wait at its gate meanwhile.
        """
        known = self._metadata.get(agent_name)
        if known == metadata:
            return agent_name
        if known is None:
            name = await self.call(self.transport.add_peer, metadata)
            self._metadata[name] = metadata
            return name
        gate = self._gates.setdefault(agent_name, asyncio.Event())
        gate.clear()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_timeout_s
            while self._inflight.get(agent_name, 0) and loop.time() < deadline:
                await asyncio.sleep(0.001)

            def reload() -> str:
                self.transport.remove_peer(agent_name)
                return self.transport.add_peer(metadata)

            name = await self.call(reload)
            self._metadata[name] = metadata
            return name
        finally:
            gate.set()

    async def post_reads(self, posts: list[ReadPost]) -> list[tuple[int | None, bool, str | None]]:
        """Post several READs in one hop; per post: (xfer id, done, error)."""
        for post in posts:
            gate = self._gates.get(post.peer)
            if gate is not None:
                await gate.wait()
        results = await self.call(self._post_reads, posts)
        for post, (xfer_id, _, _) in zip(posts, results, strict=True):
            if xfer_id is not None:
                self._xfer_peer[xfer_id] = post.peer
                self._inflight[post.peer] = self._inflight.get(post.peer, 0) + 1
        return results

    def _post_reads(self, posts: list[ReadPost]) -> list[tuple[int | None, bool, str | None]]:
        out: list[tuple[int | None, bool, str | None]] = []
        for post in posts:
            try:
                xfer_id, done = self.transport.post_read(post)
                out.append((xfer_id, done, None))
            except TransferError as exc:
                out.append((None, False, str(exc)))
        return out

    async def poll_many(self, xfer_ids: list[int]) -> dict[int, str | None]:
        """States of many transfers in one hop: 'done', 'proc' or an error message."""

        def run() -> dict[int, str | None]:
            out: dict[int, str | None] = {}
            for xfer_id in xfer_ids:
                try:
                    out[xfer_id] = "done" if self.transport.poll(xfer_id) else "proc"
                except TransferError as exc:
                    out[xfer_id] = str(exc) or "transfer failed"
            return out

        return await self.call(run)

    async def release(self, xfer_ids: list[int]) -> None:
        def run() -> None:
            for xfer_id in xfer_ids:
                self.transport.release(xfer_id)

        await self.call(run)
        for xfer_id in xfer_ids:
            peer = self._xfer_peer.pop(xfer_id, None)
            if peer is not None:
                self._inflight[peer] -= 1

    async def notifications(self) -> list[tuple[str, bytes]]:
        return await self.call(self.transport.notifications)

    async def send_notif(self, peer: str, msg: bytes) -> str | None:
        def run() -> str | None:
            try:
                self.transport.send_notif(peer, msg)
                return None
            except TransferError as exc:
                return str(exc)

        return await self.call(run)

    async def counts(self) -> TransportCounts:
        return await self.call(self.transport.counts)

    async def close(self) -> None:
        await self.call(self.transport.close)
        self._pool.shutdown(wait=True)

"""Every NIXL call, serialized: on one dedicated thread, or inline on the event loop.

NIXL agents are not thread-safe in their default sync mode (NIXL then creates its
UCX worker SERIALIZED: any thread, one at a time), and `transfer()` can copy a
whole request inline. So every call holds one lock (``_nixl``); long ones (large
posts, registration, peer loading) run on one worker thread that keeps the event
loop free, while short ones (a small READ, polls, releases, notifications) run
inline on the loop when the lock is free, saving the hop to the thread and back
(two loop wake-ups, ~0.1-1 ms on a busy host). When the worker thread
holds the lock (a large ``transfer()``), they hop like the rest.

Error contract: the transport maps NIXL's exceptions to ``TransferError`` (in one
place, kvd.transport.remote.nixl); this layer passes those objects on as they are, as
typed results (``PostResult``, ``XferStatus``) or raised, never as strings.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from kvd.daemon.clock import Clock, MonotonicClock
from kvd.errors import TransferError
from kvd.transport.base import (
    PostResult,
    ReadPost,
    Transport,
    TransportCounts,
    XferState,
    XferStatus,
)
from kvd.transport.remote.workers import poster_for

T = TypeVar("T")
log = logging.getLogger("kvd.datapath")

# A changed or forgotten peer's metadata is dropped only once no READ to it is in flight,
# however long that takes: NIXL's remove_remote_agent makes such a READ's poll fail
# (NOT_FOUND) but does not stop it (UCP endpoints close without FORCE in NIXL 1.5), so
# it could still land after its pull was reported failed. READs end when the transport
# completes or fails them (peer_liveness_timeout_s bounds a silent peer).
PEER_DRAIN_POLL_S = 0.001
PEER_DRAIN_LOG_S = 10.0
# A post of at most this many bytes and descriptors runs inline on the event loop (when
# the NIXL lock is free): UCX's cma copies ~10-15 GB/s inside transfer(), so the loop
# stalls for at most ~0.3 ms, less than a hop to the NIXL thread costs on a busy host.
INLINE_POST_MAX_BYTES = 4 << 20
INLINE_POST_MAX_DESCRIPTORS = 1024
# `warm_read`: one page read from a peer ahead of its first pull; given up (the pull pays
# as before) past WARM_READ_TIMEOUT_S.
WARM_READ_NBYTES = 4096
WARM_READ_TIMEOUT_S = 5.0


def new_nixl_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-nixl")


class DataPath:
    def __init__(self, transport: Transport, executor: ThreadPoolExecutor | None = None,
                 clock: Clock | None = None) -> None:
        self.transport = transport
        self.clock = clock or MonotonicClock()
        self._pool = executor or new_nixl_executor()
        self._nixl = threading.Lock()  # held by every transport call, on any thread
        self.inline_calls = self.thread_calls = 0
        self._metadata: dict[str, bytes] = {}  # peer agent -> metadata loaded
        self._gates: dict[str, asyncio.Event] = {}  # closed while a peer is reloaded
        self._inflight: dict[str, int] = {}  # peer agent -> transfer handles not released
        self._xfer_peer: dict[int, str] = {}
        # Peers a READ has been posted to: only those get inline posts. A first READ may
        # wait on the connection to the peer inside transfer(): on the NIXL thread that
        # wait cannot freeze the event loop (polls, other pulls' Acquires, housekeeping).
        self._posted_to: set[str] = set()
        # READs go through prepared lists per (peer, pools) when a post names its pools:
        # validated once, adjacent blocks merged by NIXL; a large READ is
        # split over the transport's posting workers when it has several.
        self._poster = poster_for(transport)
        # `warm_read`'s landing page: registered only while one runs, kept allocated (a
        # READ given up on may still land in it)
        self._scratch = np.zeros(WARM_READ_NBYTES, dtype=np.uint8)
        self._warming = asyncio.Lock()

    @property
    def agent_name(self) -> str:
        return self.transport.name

    def _locked(self, fn: Callable[..., T], *args: object) -> T:
        with self._nixl:
            return fn(*args)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """On the NIXL thread (one hop there and back)."""
        self.thread_calls += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._locked, fn,
                                                                *args)

    async def call_short(self, fn: Callable[..., T], *args: object) -> T:
        """A short call: inline when no other NIXL call runs, else on the NIXL thread."""
        if self._nixl.acquire(blocking=False):
            try:
                self.inline_calls += 1
                return fn(*args)
            finally:
                self._nixl.release()
        return await self.call(fn, *args)

    async def metadata(self) -> bytes:
        return await self.call(self.transport.metadata)

    async def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> int:
        return await self.call(self.transport.register, addr, nbytes, mem_type, device_id)

    async def deregister(self, reg_id: int) -> None:
        await self.call(self.transport.deregister, reg_id)

    def inflight(self, agent_name: str) -> int:
        return self._inflight.get(agent_name, 0)

    async def _drained(self, agent_name: str) -> None:
        next_log_s = self.clock.now() + PEER_DRAIN_LOG_S
        while self.inflight(agent_name):
            await self.clock.sleep(PEER_DRAIN_POLL_S)
            if self.clock.now() >= next_log_s:
                next_log_s += PEER_DRAIN_LOG_S
                log.warning("peer %s kept: %d READs to it still in flight", agent_name,
                            self.inflight(agent_name))

    async def load_peer(self, metadata: bytes, agent_name: str) -> str:
        """Load a peer's metadata, replacing what we knew of it.

        NIXL keeps a peer's old memory sections when metadata is loaded again, and a
        section the peer has since deregistered (its pool freed, the address reused by
        a new pool) makes a later READ fail with NOT_FOUND. So a changed peer is
        removed and loaded afresh, but only once no READ to it is in flight: new posts
        to it wait at its gate meanwhile.
        """
        pending = self._gates.get(agent_name)
        if pending is not None and not pending.is_set():  # being forgotten: after that
            await pending.wait()
        known = self._metadata.get(agent_name)
        if known == metadata:
            return agent_name
        if known is None:
            name = await self.call(self.transport.add_peer, metadata)
            self._metadata[name] = metadata
            self._posted_to.discard(name)
            return name
        gate = self._gates.setdefault(agent_name, asyncio.Event())
        gate.clear()
        try:
            await self._drained(agent_name)

            def reload() -> str:
                self.transport.remove_peer(agent_name)
                return self.transport.add_peer(metadata)

            name = await self.call(reload)
            self._metadata[name] = metadata
            self._posted_to.discard(name)
            return name
        finally:
            gate.set()

    async def forget_peer(self, agent_name: str) -> None:
        """Drop a peer (it died, restarted or is no longer used) once no READ to it is in
        flight; the next handshake loads it afresh."""
        if agent_name not in self._metadata:
            return
        gate = self._gates.setdefault(agent_name, asyncio.Event())
        gate.clear()
        try:
            await self._drained(agent_name)
            self._posted_to.discard(agent_name)
            if self._metadata.pop(agent_name, None) is not None:

                def forget() -> None:
                    self._poster.forget_peer(agent_name)
                    self.transport.remove_peer(agent_name)

                await self.call(forget)
        finally:
            gate.set()

    @staticmethod
    def _small(posts: list[ReadPost]) -> bool:
        return (sum(int(p.nbytes.sum()) for p in posts) <= INLINE_POST_MAX_BYTES
                and sum(len(p.nbytes) for p in posts) <= INLINE_POST_MAX_DESCRIPTORS)

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        """Whether `post_reads_now` would post these (unless the NIXL lock is taken)."""
        return self._small(posts) and not any(
            p.peer not in self._posted_to
            or ((g := self._gates.get(p.peer)) is not None and not g.is_set())
            for p in posts)

    def post_reads_now(self, posts: list[ReadPost]) -> list[PostResult] | None:
        """Post small READs inline and synchronously, or None when that cannot be done now
        (too big, a peer being reloaded, another NIXL call running): ``post_reads`` then.
        Without a coroutine the caller needs no task to keep a post it must not lose
        (a task and its shield would cost two loop turns per small pull)."""
        if not self.can_post_now(posts):
            return None
        if not self._nixl.acquire(blocking=False):
            return None
        try:
            self.inline_calls += 1
            results = self._post_reads(posts)
        finally:
            self._nixl.release()
        self._track(posts, results)
        return results

    async def post_reads(self, posts: list[ReadPost]) -> list[PostResult]:
        """Post several READs in one hop, one result per post."""
        for post in posts:
            gate = self._gates.get(post.peer)
            if gate is not None:
                await gate.wait()
        inline = self._small(posts) and all(p.peer in self._posted_to for p in posts)
        results = await (self.call_short if inline else self.call)(self._post_reads, posts)
        self._track(posts, results)
        return results

    async def prepare_reads(self, posts: list[ReadPost]) -> int:
        """Prepare the lists these READs would go through, posting nothing: a sample of a
        pair's pulls, ahead of its first (kvd.daemon.pull.consumer.warm_pair). How many
        would go through prepared lists. Raises TransferError like a post does."""
        def run() -> int:
            return sum(self._poster.prepare(post) for post in posts)

        return await self.call(run)

    async def warm_read(self, peer: str, remote_addr: int, nbytes: int) -> bool:
        """Read up to a page of a peer's DRAM at ``remote_addr`` into a scratch page, ahead of
        the peer's first pull: the first READ to a peer pays one-time costs inside the
        transport (UCX: ~0.5-1 ms more than the same READ later, on a 2-core host;
        benchmarks/first_transfer.py) and is posted on the NIXL thread (a first READ may
        wait on the connection); after this one, the first pull's READs post inline like
        every later one. Registered for the READ only (the shutdown balance stays 0).
        False: it failed or did not end in WARM_READ_TIMEOUT_S (the first pull then pays
        as before)."""
        async with self._warming:
            addr = int(self._scratch.ctypes.data)
            reg = await self.register(addr, self._scratch.nbytes, "DRAM", 0)
            try:
                post = ReadPost(peer=peer, local_addrs=np.array([addr], dtype=np.int64),
                                remote_addrs=np.array([remote_addr], dtype=np.int64),
                                nbytes=np.array([min(nbytes, self._scratch.nbytes)],
                                                dtype=np.int64), mem_type="DRAM",
                                notif=b"")
                [res] = await self.post_reads([post])
                deadline_s = self.clock.now() + WARM_READ_TIMEOUT_S
                while res.xfer_id is not None:  # else ended at once (released: done)
                    status = (await self.poll_many([res.xfer_id]))[res.xfer_id]
                    if status.state is not XferState.PENDING or self.clock.now() > deadline_s:
                        await self.release([res.xfer_id])
                        return status.state is XferState.DONE
                    await self.clock.sleep(PEER_DRAIN_POLL_S)
                if res.error is not None:
                    log.info("warm-up READ from %s failed: %s", peer, res.error)
                return res.done
            finally:
                await self.deregister(reg)

    def _track(self, posts: list[ReadPost], results: list[PostResult]) -> None:
        for post, res in zip(posts, results, strict=True):
            if res.error is None:
                self._posted_to.add(post.peer)
            else:
                self._suspect(post.peer)
            if res.xfer_id is not None:
                self._xfer_peer[res.xfer_id] = post.peer
                self._inflight[post.peer] = self._inflight.get(post.peer, 0) + 1

    def _post_reads(self, posts: list[ReadPost]) -> list[PostResult]:
        """Post each READ; one already done is released here, and one still running is
        polled once before returning, both in this same hop: a small pull (which UCX cma
        usually finishes inside ``transfer()``) then needs no further hop to the NIXL
        thread for its completion or its release."""
        return [self._post_one(post) for post in posts]

    def _post_one(self, post: ReadPost) -> PostResult:
        try:
            xfer_id, done = self._poster.post(post)
        except TransferError as exc:
            return PostResult(None, False, exc)
        timing = self.transport.last_post
        try:
            done = done or self.transport.poll(xfer_id)
        except TransferError as exc:
            self.transport.release(xfer_id)
            return PostResult(None, False, exc, timing)
        if done:
            self.transport.release(xfer_id)
            return PostResult(None, True, timing=timing)
        return PostResult(xfer_id, False, timing=timing)

    def _suspect(self, peer: str) -> None:
        """A READ to ``peer`` failed: it may be dead, frozen or cut off, and UCX may wait on
        its endpoint inside a post. Until a READ to it succeeds again, its posts go to
        the NIXL thread, never inline on the event loop."""
        self._posted_to.discard(peer)

    async def poll_many(self, xfer_ids: list[int]) -> dict[int, XferStatus]:
        """States of many transfers in one hop."""

        def run() -> dict[int, XferStatus]:
            out: dict[int, XferStatus] = {}
            for xfer_id in xfer_ids:
                try:
                    done = self.transport.poll(xfer_id)
                    out[xfer_id] = XferStatus(XferState.DONE if done else XferState.PENDING)
                except TransferError as exc:
                    out[xfer_id] = XferStatus(XferState.FAILED, exc)
            return out

        states = await self.call_short(run)
        for xfer_id, status in states.items():
            if status.error is not None and (peer := self._xfer_peer.get(xfer_id)):
                self._suspect(peer)
        return states

    async def release(self, xfer_ids: list[int]) -> None:
        def run() -> None:
            for xfer_id in xfer_ids:
                self.transport.release(xfer_id)

        await self.call_short(run)
        for xfer_id in xfer_ids:
            peer = self._xfer_peer.pop(xfer_id, None)
            if peer is not None:
                self._inflight[peer] -= 1

    async def notifications(self) -> list[tuple[str, bytes]]:
        return await self.call_short(self.transport.notifications)

    async def send_notif(self, peer: str, msg: bytes) -> None:
        """Raises TransferError when the notification cannot be sent. Inline only to a
        peer whose READs work (as posts: a dead or cut-off one's endpoint may wait)."""
        inline = peer in self._posted_to
        await (self.call_short if inline else self.call)(self.transport.send_notif, peer, msg)

    async def counts(self) -> TransportCounts:
        return await self.call(self.transport.counts)

    async def close(self) -> None:
        await self.call(self._poster.close)
        await self.call(self.transport.close)
        self._pool.shutdown(wait=True)

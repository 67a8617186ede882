"""A pull whose producer engine is hosted by this very daemon: no network at all.

The daemon owns both pools, so the bytes are copied here (`LocalMover`, through a
`kvd.transport.base.Copier`: kvd.transport.copies.localcopy for DRAM,
kvd.transport.copies.cudacopy for VRAM), and the control
messages a remote pull sends to the producer's daemon (Acquire, Heartbeat, ReadNotice,
Abandon) go to this daemon's own producer side in-process (`LocalPeers`, through the
dispatch the server hands over): no handshake, no Acquire round trip, no NIXL. The pull
itself is the same object with the same rules (kvd.daemon.pull.machine): the hold and
its lease, the consumer count, exactly-once events, invalid blocks on failure, the
hold released only after the copy ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

from kvd.daemon.engines.registry import EngineRegistry
from kvd.daemon.engines.table import Engine
from kvd.daemon.peers.remote import RemoteDaemon, RemoteEngine, RemoteRank
from kvd.daemon.peers.reply import Reply
from kvd.daemon.pull.burst import BurstCopies
from kvd.daemon.pull.state import Path
from kvd.errors import IncompatibleError, KvdError, TransferError
from kvd.planner import RankId
from kvd.transport.base import (
    HOST_DEVICE,
    BlockCopier,
    Copier,
    PostResult,
    ReadPost,
    XferState,
    XferStatus,
)

log = logging.getLogger("kvd.consumer")

# What the server hands over: a peer message to this daemon's producer side, answered
# now (the body) or later (an awaitable of it); raises KvdError for a refusal.
Dispatch = Callable[[object], "object | Awaitable[object]"]


class LocalPeers:
    """This daemon's own producer side, seen as the peer of a local pull.

    The subset of kvd.daemon.peers.table.PeerTable a pull's driver uses, answered
    in-process: replies carry this daemon's incarnation, as a remote daemon's would."""

    def __init__(self, registry: EngineRegistry, dispatch: Dispatch, address: str,
                 agent: str, instance: str, now: Callable[[], float]) -> None:
        self.registry = registry
        self.dispatch = dispatch
        self.address = address  # the peer address this daemon advertises
        self.agent = agent
        self.instance = instance
        self.now = now
        self.conns: Mapping[str, Any] = {}  # no connection to lose: liveness never fails it
        self._remotes: dict[tuple[str, str], RemoteEngine] = {}

    # ------------------------------------------------------------ requests

    def send(self, address: str, msg: object, timeout_s: float | None = None
             ) -> asyncio.Future[Reply]:
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        try:
            body = self.dispatch(msg)
        except Exception as exc:  # noqa: BLE001 - a refusal is the reply, as from a peer
            fut.set_exception(exc)
            return fut
        if inspect.isawaitable(body):  # an Acquire before its Publish: answered later
            task = asyncio.ensure_future(body)
            task.add_done_callback(lambda t: self._settle(fut, t))
        else:
            fut.set_result(Reply(body, self.instance, self.now()))
        return fut

    def _settle(self, fut: asyncio.Future[Reply], task: asyncio.Future[Any]) -> None:
        if fut.done():
            return
        if task.cancelled():
            fut.cancel()
        elif (exc := task.exception()) is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(Reply(task.result(), self.instance, self.now()))

    async def request(self, address: str, msg: object, timeout_s: float | None = None
                      ) -> Reply:
        return await self.send(address, msg, timeout_s)

    def take_ready(self, addresses: Iterable[str]) -> None:
        """Replies here are set when sent: nothing is ever queued."""

    def drop_address(self, address: str, why: str) -> None:
        """Nothing is cached about a connection to ourselves."""

    # ------------------------------------------------------------ the "handshake"

    def forget(self, local_engine: str, remote_engine: str) -> None:
        self._remotes.pop((local_engine, remote_engine), None)

    def cached(self, engine_id: str, remote_engine: str, address: str) -> RemoteEngine | None:
        remote = self._remotes.get((engine_id, remote_engine))
        if remote is None:
            return None
        producer = self.registry.engines.get(remote_engine)
        if producer is None or producer.epoch != remote.desc.epoch:
            return None
        return remote

    async def remote_engine(self, engine: Engine, remote_engine: str, address: str
                            ) -> RemoteEngine:
        """The producer engine as a pull sees it, from this daemon's own registry: its
        ranks' pools at their addresses in this process. Refused like a handshake: an
        engine not registered here, incompatible, or with ranks on other daemons."""
        producer = self.registry.get(remote_engine)  # NotFoundError: not here
        if producer.compat != engine.compat:
            raise IncompatibleError(
                f"engine {remote_engine!r} here is incompatible with consumer "
                f"{engine.engine_id!r}: model/dtype/layout differ ({producer.model} "
                f"{producer.layout} vs {engine.model} {engine.layout})")
        missing = producer.missing_ranks(self.address)
        if missing:
            raise KvdError(
                f"engine {remote_engine!r}: ranks {[m.key for m in missing][:8]} are not "
                "registered with this daemon; a local pull needs every rank of its producer "
                "here (ranks on other daemons are pulled through their own daemon)")
        desc = producer.desc()
        remote = RemoteEngine(desc=desc)
        remote.daemons[self.address] = RemoteDaemon(self.address, self.agent, self.instance,
                                                     desc.epoch)
        for r in desc.ranks:
            rid = RankId(r.tp_rank, r.pp_rank)
            remote.ranks[rid] = RemoteRank(rid, self.address, self.agent, r)
        self._remotes[(engine.engine_id, remote_engine)] = remote
        return remote


# A local pull's copy of up to this many bytes runs inside post(), on the event loop
# (the copier's own default is 1 MiB). Measured through kvd serve on a busy 2-core host,
# a 2 MiB (one-block) pull's time in the daemon: 0.20-0.22 ms copied inline, 0.51-0.60 ms
# on the copy threads (queue, thread wake-up, the pull's poll finding the end); break-even
# lies near 8 MiB. 4 MiB keeps the loop's longest stall near 0.3 ms.
INLINE_MAX_NBYTES = 4 << 20


def local_copier(threads: int) -> Copier:
    """The DRAM copier of a daemon's local pulls (``copy_threads`` copy threads)."""
    from kvd.transport.copies.localcopy import LocalCopier

    return LocalCopier(threads=threads, inline_max_nbytes=INLINE_MAX_NBYTES)


# A copy that did not end inside post() is waited for by a waiter thread, which wakes
# the pull the moment the copy ends: the pull's own poll backoff (up to 2 ms, and the
# event loop's timers round anything from 0.5 ms up to whole milliseconds) would
# otherwise add 1 ms on average to every large copy (a 512 MiB copy takes ~40 ms).
# ``poll`` waits at most WAKE_WAIT_S for a wake-up, then answers as before.
WAKE_WAIT_S = 0.05
# Waiter threads (each blocks on one copy); copies beyond them are woken as waiters free
# up, and are still found ended by the ordinary polls meanwhile.
MAX_WAITERS = 8
WAITER_TIMEOUT_S = 30.0


def _wait_end(copier: Copier, handle: int) -> None:
    """A waiter thread's work: block until the copy ends (its outcome is read by poll)."""
    try:
        copier.wait(handle, WAITER_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - failed, released meanwhile: poll reports it
        pass


def _regions(pools: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(int(a), int(n)) for a, n in pools]


class LocalMover:
    """Copies between two pools this daemon maps (DRAM: `LocalCopier`; VRAM: the CUDA
    copier, created at start-up by `start_cuda` or at first use). A copy always ends:
    nothing to sever."""

    path = Path.LOCAL

    def __init__(self, copier: Copier,
                 cuda_copier: Callable[[], Copier] | None = None) -> None:
        self.copier = copier
        self._make_cuda = cuda_copier
        self._cuda: Copier | None = None
        self._cuda_started: concurrent.futures.Future[Copier] | None = None
        self._where: dict[int, Copier] = {}  # handle -> the copier that holds it
        # handle -> done when its copy has ended (or its waiter gave up): wakes the poll
        self._wakes: dict[int, asyncio.Future[None]] = {}
        self._waiters: concurrent.futures.ThreadPoolExecutor | None = None
        # Whether more requests wait on the engine face (the server sets it): a small
        # copy then joins the burst's (kvd.daemon.pull.burst) instead of running inline.
        self.more_waiting: Callable[[], bool] = _never
        self.burst = BurstCopies()

    def _copier_for(self, post: ReadPost) -> tuple[Copier, dict[str, Any]]:
        """DRAM to DRAM: the copy threads. Any side in VRAM: the CUDA copier, a DRAM
        side named as the host (its copies staged through page-locked slots)."""
        local_mem = post.local_mem_type or post.mem_type
        if post.mem_type != "VRAM" and local_mem != "VRAM":
            regions = {}
            if post.local_pools and post.remote_pools:
                regions = {"dst_regions": _regions((p.base, p.nbytes) for p in post.local_pools),
                           "src_regions": _regions((p.base, p.nbytes)
                                                   for p in post.remote_pools)}
            return self.copier, regions
        if self._cuda is None:
            if self._make_cuda is None:
                raise TransferError("a local pull from or to a VRAM pool needs CUDA here")
            started = self._cuda_started
            self._cuda = started.result() if started is not None else self._make_cuda()
        return self._cuda, {
            "dst_devs": post.local_devs if local_mem == "VRAM" else HOST_DEVICE,
            "src_devs": post.remote_devs if post.mem_type == "VRAM" else HOST_DEVICE}

    def start_cuda(self) -> None:
        """Create the CUDA copier now, on a thread (a daemon of CUDA pools at start-up):
        its kernels then compile there, off the event loop, before the first pull (which
        would otherwise create it; pulls while they compile copy piece by piece)."""
        if self._make_cuda is None or self._cuda_started is not None or self._cuda is not None:
            return
        fut: concurrent.futures.Future[Copier] = concurrent.futures.Future()

        def make() -> None:
            try:
                fut.set_result(self._make_cuda())
            except BaseException as exc:  # noqa: BLE001 - re-raised at the first VRAM pull
                fut.set_exception(exc)

        self._cuda_started = fut
        threading.Thread(target=make, name="kvd-cuda-start", daemon=True).start()

    def can_post_now(self, posts: list[ReadPost]) -> bool:
        return True  # a post starts copies on the copy threads; small ones end inline

    def post_now(self, posts: list[ReadPost]) -> list[PostResult] | None:
        results = []
        for post in posts:
            try:
                copier, extra = self._copier_for(post)
                if post.blocks is not None and hasattr(copier, "post_blocks"):
                    # addresses made on the GPU
                    handle = cast(BlockCopier, copier).post_blocks(post.blocks)
                elif self._joins_burst(copier, post):
                    handle, wake = self.burst.defer(
                        copier, (post.local_addrs, post.remote_addrs, post.nbytes), extra)
                    self._wakes[handle] = wake
                    results.append(PostResult(handle, False))
                    continue
                else:
                    handle = copier.post(post.local_addrs, post.remote_addrs, post.nbytes,
                                         **extra)
            except (KvdError, ValueError) as exc:
                err = exc if isinstance(exc, TransferError) else TransferError(str(exc))
                results.append(PostResult(None, False, err))
                continue
            try:
                done = copier.poll(handle)
            except TransferError as exc:
                copier.release(handle)
                results.append(PostResult(None, False, exc))
                continue
            if done:
                copier.release(handle)
                results.append(PostResult(None, True))
            else:
                self._where[handle] = copier
                # A waiter thread wakes the pull when the copy ends (DRAM: the copy
                # threads' completion; VRAM: the copy's CUDA events, synchronised
                # off the loop) instead of the pull polling on a timer.
                self._watch(copier, handle)
                results.append(PostResult(handle, False))
        return results

    def _joins_burst(self, copier: Copier, post: ReadPost) -> bool:
        """A small DRAM copy while a burst of requests is being read (or its copies are
        queued): queued, to run with the burst's when the face has read it."""
        if copier is not self.copier or not (self.burst.queued or self.more_waiting()):
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False  # posted off the loop (tests): inline
        return _total_nbytes(post) <= getattr(copier, "inline_max_nbytes", 0)

    def _watch(self, copier: Copier, handle: int) -> None:
        """Have a waiter thread wake the event loop when this copy ends."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # posted off the loop (tests): plain polling
        if self._waiters is None:
            self._waiters = concurrent.futures.ThreadPoolExecutor(
                MAX_WAITERS, thread_name_prefix="kvd-copy-wait")
        self._wakes[handle] = loop.run_in_executor(self._waiters, _wait_end, copier, handle)

    async def post(self, posts: list[ReadPost]) -> list[PostResult]:
        results = self.post_now(posts)
        assert results is not None
        return results

    async def poll(self, handles: list[int]) -> dict[int, XferStatus]:
        """The copies' states; while all of them are running, first waits (at most
        WAKE_WAIT_S) for one to end, so that a pull hears of its copy's end at once."""
        out = self._states(handles)
        wake = [self._wakes[h] for h, st in out.items()
                if st.state is XferState.PENDING and h in self._wakes]
        if wake and all(st.state is XferState.PENDING for st in out.values()):
            await asyncio.wait(wake, timeout=WAKE_WAIT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            out = self._states(handles)
        return out

    def _states(self, handles: list[int]) -> dict[int, XferStatus]:
        out: dict[int, XferStatus] = {}
        for h in handles:
            if h in self.burst:
                out[h] = self.burst.status(h)
                continue
            try:
                done = self._where[h].poll(h)
                out[h] = XferStatus(XferState.DONE if done else XferState.PENDING)
            except TransferError as exc:
                out[h] = XferStatus(XferState.FAILED, exc)
        return out

    async def release(self, handles: list[int]) -> None:
        """A copy cannot be recalled: one still running (a daemon stopping mid-copy) is
        waited for, off the event loop, before its handle goes."""
        for h in handles:
            copier = self._where.pop(h, None)
            self._wakes.pop(h, None)
            if h in self.burst:
                went = self.burst.release(h)  # queued: dropped, never run
                if went is None:
                    continue
                copier, h = went
            if copier is None:
                continue
            if _ended(copier, h):
                copier.release(h)
            else:
                await asyncio.get_running_loop().run_in_executor(None, copier.release, h)

    async def sever(self, producers: Mapping[str, tuple[str, ...]]) -> None:
        """Nothing to sever: a local copy ends by itself."""

    def close(self) -> None:
        """The daemon stops: wait for running copies, stop the copy threads."""
        self.copier.close()
        if self._cuda is None and self._cuda_started is not None \
                and self._cuda_started.done() and self._cuda_started.exception() is None:
            self._cuda = self._cuda_started.result()
        if self._cuda is not None:
            self._cuda.close()
        if self._waiters is not None:  # every copy has ended: the waiters return
            self._waiters.shutdown(wait=False)


def _never() -> bool:
    return False


def _total_nbytes(post: ReadPost) -> int:
    n = post.nbytes
    return sum(n) if isinstance(n, tuple) else int(n.sum())


def _ended(copier: Copier, handle: int) -> bool:
    try:
        return bool(copier.poll(handle))
    except TransferError:
        return True  # failed: ended


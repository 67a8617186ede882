"""The engine registry: registration, allocation, liveness, expiry and pool collection.

One owner for everything about an engine rank's life on this daemon: refuse a
bad registration before any memory exists (pool size capped by
``max_pool_bytes``), allocate and NIXL-register the pool (freeing it again on
any error), keep ranks alive on ping, retire silent ones, and free a retired
rank's pool once nothing pins it. Other owners hear "an engine is gone" through
``on_engine_gone`` (the producer releases its un-acquired requests).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvd.config import Config
from kvd.daemon.clock import Clock, StallGap
from kvd.daemon.datapath import DataPath
from kvd.daemon.engines.table import (
    Engine,
    EngineRank,
    EngineTable,
    resolve_registration,
    validate_registration,
)
from kvd.errors import (
    BusyError,
    IncompatibleError,
    IncompleteEngineError,
    InvalidRequestError,
    KvdError,
    NotFoundError,
    TooLargeError,
)
from kvd.ops.metrics import Metrics
from kvd.planner import RankId
from kvd.pool.adopt import adopt_file, adopt_memfd, file_id, is_memfd_handle
from kvd.pool.base import Pool
from kvd.pool.owner import PoolOwner, mapped_by_another, reap_dead_pools
from kvd.pool.shm import ShmPool
from kvd.wire import protocol as P

log = logging.getLogger("kvd.registry")

T = TypeVar("T")
RANK_WAIT_POLL_S = 0.01  # how often a pull re-checks for its engine's missing ranks


class EngineRegistry:
    def __init__(self, cfg: Config, clock: Clock, metrics: Metrics, datapath: DataPath,
                 daemon_id: str, instance_id: str) -> None:
        self.cfg = cfg
        self.clock = clock
        self.metrics = metrics
        self.datapath = datapath
        self.daemon_id = daemon_id
        self.instance_id = instance_id
        self.table = EngineTable(cfg.max_engines)
        self._gone_listeners: list[Callable[[str], None]] = []
        self._collect_lock = asyncio.Lock()
        self._register_lock = asyncio.Lock()
        self._undoing: set[asyncio.Task[None]] = set()  # see _off_loop
        self.pool_owner: PoolOwner | None = None
        self._page_counts: Counter[int] = Counter()  # DRAM pools allocated, by page size
        self._stall = StallGap(clock.now())  # housekeeping's looks at the engines' silence

    def open(self) -> None:
        """At start: remove the pool files that dead incarnations with this shm_dir and
        prefix left behind (kill -9 skips every cleanup), then claim this incarnation's
        with an owner lock held until close(). Live daemons' files are never touched.
        (A cuda daemon too: its ranks may ask for DRAM pools.)"""
        reap_dead_pools(self.cfg.shm_dir, self.cfg.shm_prefix)
        self.pool_owner = PoolOwner.acquire(self.cfg.shm_dir, self.cfg.shm_prefix)

    def close(self) -> None:
        if self.pool_owner is not None:
            self.pool_owner.release()
            self.pool_owner = None

    def on_engine_gone(self, listener: Callable[[str], None]) -> None:
        """``listener(engine_id)`` runs when the last rank of an engine here goes."""
        self._gone_listeners.append(listener)

    # ------------------------------------------------------------ lookups

    @property
    def engines(self) -> dict[str, Engine]:
        return self.table.engines

    def get(self, engine_id: str) -> Engine:
        return self.table.get(engine_id)

    def rank_ids(self, engine_id: str) -> set[RankId]:
        return self.table.rank_ids(engine_id)

    def rank_count(self) -> int:
        return self.table.rank_count()

    async def complete(self, engine_id: str, timeout_s: float) -> Engine:
        """The engine once every rank it needs here is registered, waiting at most
        ``timeout_s`` (ranks of one engine register one by one); else a clear error."""
        deadline = self.clock.now() + timeout_s
        while True:
            engine = self.get(engine_id)
            missing = engine.missing_ranks(self.cfg.peer_advertise)
            if not missing:
                return engine
            if self.clock.now() >= deadline:
                raise IncompleteEngineError(
                    f"engine {engine_id!r} TP {engine.par.tp_size} x PP {engine.par.pp_size}: "
                    f"ranks {[r.key for r in missing][:16]} are not registered on this daemon "
                    f"(waited {timeout_s}s); register every rank, or list the daemons hosting "
                    "them in engine_daemons")
            await self.clock.sleep(RANK_WAIT_POLL_S)

    # ------------------------------------------------------------ engine face

    async def register(self, msg: P.RegisterEngine) -> P.Registered:
        # kv_layout "auto" becomes a concrete layout here, before anything keeps the
        # message: the engine, its compatibility hash and every EngineDesc a peer sees
        # carry the resolved name, and the reply tells the engine which one it got.
        msg = resolve_registration(msg)
        par, cache, first = validate_registration(msg)
        self.table.check_joinable(msg, par)
        if self.rank_count() >= self.cfg.max_engines:
            raise BusyError(f"{self.rank_count()} engine ranks registered (max_engines)")
        nbytes = cache.total_nbytes  # Python ints: no overflow, whatever the message says
        if nbytes > self.cfg.max_pool_bytes:
            raise TooLargeError(f"pool of {nbytes} bytes exceeds max_pool_bytes "
                                f"({self.cfg.max_pool_bytes}); lower num_blocks")
        async with self._register_lock:  # one at a time: the checks above hold until add()
            self._check_memory(msg, self.table.check_joinable(msg, par))
            if self.rank_count() >= self.cfg.max_engines:
                raise BusyError(f"{self.rank_count()} engine ranks registered (max_engines)")
            back = self._taken_back(msg, nbytes)
            if back is not None:
                return self._registered(msg, par, cache, first, back.pool, "DRAM",
                                        back.device_id, back.reg_id)
            pool, mem_type, device_id, reg_id = await self._allocate_registered(msg, nbytes)
            return self._registered(msg, par, cache, first, pool, mem_type, device_id, reg_id)

    def _taken_back(self, msg: P.RegisterEngine, nbytes: int) -> EngineRank | None:
        """A rank this daemon retired while its engine lived on (DORMANT: silent past
        engine_timeout_s while frozen, or its connection closed), asking for its own pool
        back (``adopt_pool`` naming it): the pool and its NIXL registration carry on
        under the new registration, the bytes never moved. None: not such a request."""
        old = msg.adopt_pool
        if old is None:
            return None
        back = self.table.dormant(msg.engine_id, RankId(msg.tp_rank, msg.pp_rank), old.name)
        if back is None:
            return None
        if back.pool.nbytes != nbytes:
            raise InvalidRequestError(f"cannot take back pool {old.name!r}: it holds "
                                      f"{back.pool.nbytes} bytes; this geometry needs {nbytes}")
        self.table.freed(back)  # off the retired list: the new rank owns its pool now
        self.metrics.pool_bytes.dec(back.pool.nbytes)  # counted again by _registered
        self._pages_changed(back.pool, -1)
        log.warning("engine %s rank %s registered again after it was retired; it takes its "
                    "pool %s back (the KV memory stayed in place)", msg.engine_id,
                    back.rank.key, old.name, extra={"engine_id": msg.engine_id})
        return back

    def _registered(self, msg: P.RegisterEngine, par: Any, cache: Any, first: int, pool: Pool,
                    mem_type: str, device_id: int, reg_id: int) -> P.Registered:
        rank = EngineRank(engine_id=msg.engine_id, rank=RankId(msg.tp_rank, msg.pp_rank), msg=msg,
                          cache=cache, first_layer=first, pool=pool, reg_id=reg_id,
                          last_seen_s=self.clock.now(), device_id=device_id)
        self.table.add(msg, par, rank, mem_type)
        if self.cfg.prefault_pools and isinstance(pool, ShmPool) and pool.adopted_from is None:
            pool.prefault_in_background()  # a new pool's pages: none faulted yet
        self.metrics.pool_bytes.inc(pool.nbytes)
        self._pages_changed(pool, +1)
        self.metrics.engines.set(self.rank_count())
        log.info("registered engine %s rank %s (%d bytes, %s %s)", msg.engine_id,
                 rank.rank.key, pool.nbytes, msg.layout.kv_layout, msg.layout.head_layout,
                 extra={"engine_id": msg.engine_id})
        return P.Registered(pool=pool.handle(cache.shape, msg.model.dtype),
                            daemon_id=self.daemon_id, peer_address=self.cfg.peer_advertise,
                            instance_id=self.instance_id, layout=msg.layout)

    async def _allocate_registered(self, msg: P.RegisterEngine, nbytes: int
                                   ) -> tuple[Pool, str, int, int]:
        """(pool, memory type, device id, NIXL registration id), made off the event loop.

        Allocating a DRAM pool reserves every page (posix_fallocate: ~0.25 s per GiB here)
        and NIXL registers it on its own thread; on the loop, either would stall every
        engine's Ping and Poll as long (their budget is 50 ms). VRAM pools are allocated on the loop
        (a cudaMalloc, milliseconds) so that CUDA calls stay on one thread, and adopted
        pools too (mapped, not reserved: their pages exist). Cancelled
        (daemon stopping) meanwhile: the work finishes on its thread and is undone."""
        if self.cfg.device == "cuda" or msg.adopt_pool is not None:  # no pages to reserve
            pool, mem_type, device_id = self._allocate(msg, nbytes)
        else:
            async def close(made: tuple[Any, str, int]) -> None:
                made[0].close()

            pool, mem_type, device_id = await self._off_loop(
                asyncio.get_running_loop().run_in_executor(None, self._allocate, msg, nbytes),
                close)

        # An adopted pool is the engine's memory: a failed registration gives it back
        # under its old name (the engine may ask again) rather than deleting it.
        discard = pool.give_back if msg.adopt_pool is not None else pool.close

        async def undo(reg_id: int) -> None:
            try:
                await self.datapath.deregister(reg_id)
            finally:
                discard()

        try:
            reg_id = await self._off_loop(asyncio.ensure_future(self.datapath.register(
                pool.addr, pool.nbytes, mem_type, device_id)), undo)
        except asyncio.CancelledError:
            raise  # the pool goes with the registration, once that ends (undo)
        except BaseException:
            discard()
            raise
        return pool, mem_type, device_id, reg_id

    async def _off_loop(self, work: asyncio.Future[T],
                        undo: Callable[[T], Coroutine[Any, Any, None]]) -> T:
        """``work``'s result; if the caller is cancelled first, the work (running on a
        thread) is left to end and ``undo`` gets what it made, so that nothing leaks
        (`release_all` waits for those undos)."""
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            async def finish() -> None:
                try:
                    made = await work
                except BaseException:  # noqa: BLE001 - it failed: nothing was made
                    return
                await undo(made)

            task = asyncio.get_running_loop().create_task(finish())
            self._undoing.add(task)
            task.add_done_callback(self._undoing.discard)
            raise

    def _memory_of(self, msg: P.RegisterEngine) -> str:
        """Where this rank's pool lives: VRAM on a cuda daemon unless the rank asks for
        DRAM (``device_index`` = ``DRAM_DEVICE_INDEX``), else DRAM."""
        if self.cfg.device == "cuda" and msg.device_index != P.DRAM_DEVICE_INDEX \
                and msg.adopt_pool is None:
            return "VRAM"
        return "DRAM"

    def _check_memory(self, msg: P.RegisterEngine, engine: Engine | None) -> None:
        """One engine keeps its KV in one kind of memory: a rank whose pool would be of
        the other kind than its engine's ranks already here is refused."""
        mem = self._memory_of(msg)
        if engine is not None and engine.mem_type != mem:
            raise IncompatibleError(
                f"engine {msg.engine_id!r} rank {msg.tp_rank}/{msg.pp_rank}: its pool would be "
                f"{mem}, its other ranks' are {engine.mem_type}; one engine keeps its KV in "
                "one kind of memory")

    def _allocate(self, msg: P.RegisterEngine, nbytes: int) -> tuple[Pool, str, int]:
        """(pool, NIXL memory type, device id): shm in DRAM, or VRAM on the rank's GPU;
        or the pool the engine kept from a previous incarnation (``adopt_pool``)."""
        if msg.adopt_pool is not None:
            return self._adopt(msg.adopt_pool, nbytes), "DRAM", 0
        try:
            if self._memory_of(msg) == "VRAM":
                from kvd.pool.cuda import CudaPool

                return (CudaPool.create(self.cfg.shm_prefix, nbytes, msg.device_index), "VRAM",
                        msg.device_index)
            return ShmPool.create(self.cfg.shm_prefix, nbytes, self.cfg.shm_dir,
                                  backing=self.cfg.pool_backing, owner=self.pool_owner,
                                  max_nbytes=self.cfg.max_pool_bytes), "DRAM", 0
        except KvdError:
            raise
        except (OSError, OverflowError, ValueError, MemoryError) as exc:
            raise KvdError(f"cannot allocate a pool of {nbytes} bytes: {exc}") from None

    def _adopt(self, old: P.PoolHandle, nbytes: int) -> ShmPool:
        """Take over a pool a live engine kept across a daemon restart (``adopt_file``
        and ``adopt_memfd`` say what is checked); one-line refusals otherwise: the
        engine keeps computing locally."""
        def refuse(why: str) -> InvalidRequestError:
            return InvalidRequestError(f"cannot adopt pool {old.name!r}: {why}")

        if self.cfg.device != "cpu" or old.kind != "shm" or self.pool_owner is None:
            raise refuse("only DRAM pools (files in shm_dir, memfds) can be adopted; VRAM "
                         "pools are not yet (docs/operations.md)")
        if old.nbytes != nbytes:
            raise refuse(f"its handle says {old.nbytes} bytes; this geometry needs {nbytes}")
        if is_memfd_handle(old.directory):  # the engine hands back its fd (kvd.pool.adopt)
            taken = [file_id(r.pool.fd) for e in self.engines.values()
                     for r in e.ranks.values() if getattr(r.pool, "fd", None) is not None]
            try:
                return adopt_memfd(old.directory, old.name, nbytes, self.pool_owner, taken,
                                   max_nbytes=self.cfg.max_pool_bytes)
            except KvdError:
                raise
            except (OSError, ValueError) as exc:
                raise refuse(str(exc)) from None
        if os.path.realpath(old.directory) != os.path.realpath(self.cfg.shm_dir):
            raise refuse(f"it lives in {old.directory}, not in this daemon's shm_dir "
                         f"{self.cfg.shm_dir}")
        if any(r.pool.name == old.name for e in self.engines.values() for r in e.ranks.values()):
            raise refuse("already registered here")
        try:
            return adopt_file(old.name, nbytes, self.cfg.shm_dir, self.pool_owner,
                                 max_nbytes=self.cfg.max_pool_bytes)
        except KvdError:
            raise
        except (OSError, ValueError) as exc:
            raise refuse(str(exc)) from None

    def deregister(self, engine_id: str, rank: RankId) -> None:
        self.mark_gone(engine_id, rank, "deregistered")

    def ping(self, engine_id: str, rank_id: RankId) -> None:
        engine = self.table.engines.get(engine_id)
        rank = engine.ranks.get(rank_id) if engine else None
        if rank is None:
            raise NotFoundError(f"engine {engine_id!r} rank {rank_id.key} is not registered "
                                f"(daemon restarted? instance {self.instance_id}): register "
                                "again")
        rank.last_seen_s = self.clock.now()

    def mark_gone(self, engine_id: str, rank: RankId, why: str, revivable: bool = False
                  ) -> None:
        """Retire a rank now (its pool is freed after the last unpin). ``revivable``: the
        engine did not say it left (silent, its connection closed); while it still maps
        the pool, the pool is kept for it to take back (`_taken_back`)."""
        gone = self.table.mark_gone(engine_id, rank)
        if gone is None:
            raise NotFoundError(f"engine {engine_id!r} rank {rank.key} is not registered")
        gone.revivable = revivable
        log.info("engine %s rank %s %s", engine_id, rank.key, why,
                 extra={"engine_id": engine_id})
        engine = self.table.engines.get(engine_id)
        if engine is None or not engine.ranks:
            for listener in self._gone_listeners:
                listener(engine_id)
        self.metrics.engines.set(self.rank_count())

    def retire_engine(self, engine_id: str, why: str) -> None:
        """Retire every live rank of an engine now (its connections closed)."""
        engine = self.table.engines.get(engine_id)
        for rank in list(engine.live_ranks()) if engine else []:
            self.mark_gone(engine_id, rank.rank, why, revivable=True)

    # ------------------------------------------------------------ housekeeping

    def expire(self, now_s: float) -> None:
        """Retire ranks silent (no ping) for engine_timeout_s, not counting time this
        daemon itself could not run: the pings sent meanwhile still wait in its socket,
        and retiring now would take P/D away from a live engine for a stall of ours (a
        starved host, a VM pause). Their silence is moved on by the gap instead, as the
        producer's leases are."""
        timeout_s = self.cfg.engine_timeout_s
        stalled_s = self._stall.step(now_s)
        if stalled_s:
            for engine in self.table.engines.values():
                for rank in engine.live_ranks():
                    rank.last_seen_s += stalled_s
            log.warning("daemon was stalled %.1fs: engines' silence not counted for as long",
                        stalled_s)
        for engine in list(self.table.engines.values()):
            for rank in engine.live_ranks():
                if now_s - rank.last_seen_s > timeout_s:
                    self.mark_gone(engine.engine_id, rank.rank,
                                   f"silent for {timeout_s}s: treated as gone (its pool is "
                                   "kept while it maps it: registering again takes it back)",
                                   revivable=True)

    async def collect(self) -> None:
        """Free retired, unpinned pools, shielded from cancellation.

        stop() cancels housekeeping, possibly in the middle of a deregistration; the
        shielded collection finishes anyway (a rank stays on the retired list until its
        pool is freed) and the next collect() waits for it on the lock.
        """
        await asyncio.shield(self._collect_locked())

    async def _collect_locked(self) -> None:
        async with self._collect_lock:
            for rank in self.table.collectable(keep=self._still_mapped):
                try:
                    await self.datapath.deregister(rank.reg_id)
                finally:
                    # Off the loop: unmapping and unlinking a pool frees its pages
                    # (~0.1 s per GiB here), which would stall every engine's Ping.
                    await asyncio.get_running_loop().run_in_executor(None, rank.pool.close)
                    self.table.freed(rank)
                    self.metrics.pool_bytes.dec(rank.pool.nbytes)
                    self._pages_changed(rank.pool, -1)

    def _still_mapped(self, rank: EngineRank) -> bool:
        """Whether the engine of a revivable retired rank still maps its pool (a file pool:
        the engine's shared flock on it); memfd and VRAM pools are not kept."""
        pool = rank.pool
        if not isinstance(pool, ShmPool) or pool.fd is not None:
            return False
        return mapped_by_another(pool.directory / pool.name)

    async def release_all(self) -> None:
        """At stop, after every transfer task was cancelled and released: free every pool."""
        for engine in list(self.table.engines.values()):
            for rank_id in list(engine.ranks):
                self.mark_gone(engine.engine_id, rank_id, "released at stop")
        for rank in self.table.retired:
            rank.pins = 0  # nothing can touch them any more
            rank.revivable = False  # nor be taken back
        await self.collect()
        while self._undoing:  # registrations cancelled midway: deregistered, freed
            await asyncio.gather(*self._undoing, return_exceptions=True)

    def status(self) -> list[P.RankStatus]:
        out = []
        for e in self.table.engines.values():
            retired = [x for x in self.table.retired if x.engine_id == e.engine_id]
            for r in [*e.live_ranks(), *retired]:
                out.append(P.RankStatus(engine_id=e.engine_id, rank=r.rank.key,
                                        tp_size=e.par.tp_size, pp_size=e.par.pp_size,
                                        pool=r.pool.name, pool_bytes=r.pool.nbytes,
                                        gone=r.gone, pins=r.pins,
                                        page_bytes=getattr(r.pool, "page_nbytes", 0),
                                        backing=_backing(r.pool)))
        return out

    def _pages_changed(self, pool: Pool, delta: int) -> None:
        """kvd_pool_page_bytes: the smallest page among the DRAM pools still allocated,
        so that an alert sees a pool that fell back to 4 KiB pages."""
        page = getattr(pool, "page_nbytes", 0)
        if not page:
            return  # VRAM: no host pages
        self._page_counts[page] += delta
        if self._page_counts[page] <= 0:
            del self._page_counts[page]
        self.metrics.pool_page_bytes.set(min(self._page_counts, default=0))


def _backing(pool: Pool) -> str:
    backing = getattr(pool, "backing", None)
    return backing.value if backing is not None else "cuda_ipc"

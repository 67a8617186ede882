"""Worker side: put vLLM's KV cache inside kvd's pool, check it, report completions.

Runs in each vLLM worker process. Registration happens before vLLM allocates,
so kvd owns the memory NIXL reads and writes (zero copy); afterwards every
layer view is checked against kvd's layout. Only the first rank polls the
daemon: kvd reports per engine, not per rank (get_finished_count is 1). A step that
computes tokens never waits on the daemon: it checks for events without blocking, with
a thread as the fallback (kvd.integrations.connector_core.completions); a step that
computes none while transfers are out waits for their events, at most
``kvd_idle_wait_s`` (``kvd_progressive_idle_wait_s`` while every pull out is progressive).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from kvd.client import EventCursor, KvdClient, RankHandle
from kvd.errors import KvdError, KvdTimeoutError, LayoutError
from kvd.integrations.connector_core import cpu_binding
from kvd.integrations.connector_core.completions import EventPoller, EventPump
from kvd.integrations.connector_core.events import EventBook, StepReport
from kvd.integrations.connector_core.geometry import LayerView, VllmKvGeometry, check_views
from kvd.integrations.connector_core.hybrid import VllmHybridGeometry, check_hybrid_views
from kvd.integrations.connector_core.messages import Handshake, StepAnnouncements, WorkerRejoined
from kvd.integrations.connector_core.preflight import unreachable_line
from kvd.integrations.connector_core.rejoin import Rejoin
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.integrations.connector_core.steplog import step_log
from kvd.ops.trace import TRACE

log = logging.getLogger("kvd.vllm")


class KvdWorker:
    def __init__(self, settings: ConnectorSettings, geom: VllmKvGeometry | VllmHybridGeometry,
                 multi_group: bool = False, now: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        step_log.start()  # the thread that writes the step's log lines, started here
        self._now = now
        self.geom = geom
        self.reports = geom.tp_rank == 0 and geom.pp_rank == 0
        self.book = EventBook(multi_group=multi_group)
        self.client = KvdClient(settings.address, token=settings.token,
                                timeout_s=settings.request_timeout_s, on_lost=self._lost)
        self.handle: RankHandle | None = None
        self.cursor = EventCursor(settings.engine_id)
        self._restarts_seen = 0
        self.poller: EventPoller | None = None
        self.pump: EventPump | None = None
        self.rejoin = Rejoin(
            self.client, lambda: self.handle, self._rejoined,
            f"{settings.engine_id} rank {geom.tp_rank}/{geom.pp_rank}",
            make_client=lambda: KvdClient(settings.address, token=settings.token,
                                          timeout_s=settings.request_timeout_s,
                                          ping_interval_s=0))
        self._announced = ""  # the daemon instance the scheduler last heard of from us
        self._steps = 0  # steps whose announcements came (groups the pulls of a step)
        self._idle_wait_s = 0.0  # this step computes nothing: wait this long for events
        self._aliases: dict[str, str] = {}  # transfer id -> request id (progressive)

    def _lost(self, reason: str) -> None:
        """The pinger's: the daemon no longer knows this rank (it restarted) or does not
        answer. Either way try to register again, with adoption, off the step."""
        log.warning("kvd lost this engine's registration or does not answer (%s); "
                    "registering again in the background", reason)
        self.rejoin.kick(reason)

    def _rejoined(self, handle: RankHandle) -> None:
        """The rejoin thread's (never the step's): the rank is registered again."""
        restarted = self.handle is None or handle.instance_id != self.handle.instance_id
        self.handle = handle  # same mapping; the step's next worker_meta tells the scheduler
        self.cursor.note_instance(handle.instance_id)  # (a restart, if no poll said so yet)
        if restarted and self.reports:
            self._warm_up()  # a new daemon knows none of our producers: greet them again

    # ------------------------------------------------------------ memory

    def register(self) -> RankHandle:
        """Register the rank; kvd allocates a pool of exactly vLLM's KV size."""
        if self.handle is None:
            self.geom.check_allocation()
            g = self.geom
            try:
                self.handle = self.client.register(
                    self.settings.engine_id, g.model_spec(), g.layout_spec(),
                    tp_rank=g.tp_rank, tp_size=g.tp_size, pp_rank=g.pp_rank,
                    pp_size=g.pp_size, layer_partition=g.layer_partition)
            except KvdTimeoutError:
                line = unreachable_line(self.settings.address, "no answer to registering "
                                        f"within {self.settings.request_timeout_s:g}s")
                log.error("%s", line)
                raise KvdTimeoutError(line) from None
            self._announced = self.handle.instance_id  # the handshake tells the scheduler
            # The incarnation we registered with, before any poll reply: a daemon that
            # restarts before the first one answers is then a restart too (its pulls in
            # flight fail at once, not after kvd_pull_timeout_s).
            self.cursor.note_instance(self.handle.instance_id)
            if self.reports:
                self.pump = EventPump(self.settings, self.cursor, self._now)
                self.poller = EventPoller(self.settings, self.cursor, self._now)
                self._warm_up()
            log.info("kvd pool %s (%d bytes, %s) registered for engine %s rank %d/%d",
                     self.handle.pool.handle.name, self.handle.pool.handle.nbytes,
                     getattr(g, "kv_layout", "hybrid"), self.settings.engine_id, g.tp_rank,
                     g.pp_rank)
            if self.handle.pool.handle.kind != "cuda_ipc":
                # CPU engines only (vLLM binds no threads on GPUs); once, off the step.
                cpu_binding.warn_if_shared()
        return self.handle

    def _warm_up(self) -> None:
        """At start-up, and after a restart of the daemon (its incarnation changed): name
        this engine's producers (``kvd_producers``) to its daemon, which greets them in
        the background (answered at once). Never inside a step."""
        if not self.settings.producers:
            return
        try:
            self.client.warm_up(self.settings.engine_id, self.settings.producers)
        except KvdError as exc:  # an earlier daemon: the first pulls greet, as before
            log.info("kvd did not take the warm-up of %d producers (%s); the first pull "
                     "from each greets it", len(self.settings.producers), exc)

    def allocation_context(self) -> contextlib.AbstractContextManager:
        handle = self.register()
        if handle.pool.handle.kind == "cuda_ipc":
            from kvd.integrations.connector_core.cuda_alloc import cuda_pool_context

            return cuda_pool_context(handle.pool)
        return _cpu_pool_context(handle)

    def check_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        handle = self.register()
        pool = handle.pool.handle
        views = [LayerView(name=name, data_ptr=int(t.data_ptr()), shape=tuple(t.shape),
                           strides_nbytes=tuple(s * t.element_size() for s in t.stride()))
                 for name, t in kv_caches.items()]
        g = self.geom
        if isinstance(g, VllmHybridGeometry):
            check_hybrid_views(g.model_spec(), g.layout_spec(), g.tp_size, g.pp_size,
                               g.pp_rank, views, _pool_addr(handle), pool.nbytes,
                               g.layer_partition, g.layer_numbers)
            return
        check_views(g, views, _pool_addr(handle), pool.nbytes)

    def handshake(self) -> Handshake:
        handle = self.register()
        return Handshake(peer_address=handle.peer_address, daemon_id=handle.daemon_id,
                            instance_id=handle.instance_id)

    # ------------------------------------------------------------ completions

    def on_metadata(self, meta: StepAnnouncements) -> None:
        """Start of a step: note the scheduler's announcements, ask for events (the
        reply comes during the forward pass; ``step`` takes it)."""
        if meta.rejoin:  # every rank: its own registration is gone too
            self.rejoin.kick("kvd said this engine is not registered")
        if not self.reports:
            return
        now_s = self._now()
        self._steps += 1
        if meta.recv:
            self.book.announce_step(meta.recv, now_s + self.settings.pull_timeout_s,
                                    group=self._steps)
        for rid in meta.quiet:
            self.book.announce_quiet(rid)
        for rid, blocks in meta.failed.items():
            self.book.announce_failed_submit(rid, blocks)
        for rid, blocks in meta.refused.items():
            self.book.pull_refused(rid, blocks)
        self._aliases.update(meta.aliases)
        for rid, give_up_s in meta.sent.items():
            self.book.announce_send(rid, now_s + give_up_s)
        for rid in meta.send_refused:
            self.book.send_refused(rid)
        # A step that computes nothing while transfers are out: wait in it for kvd's
        # events (woken by them) rather than spin through empty steps that take the
        # CPU the daemon needs to finish them.
        # (settings.idle_wait_s: events end the wait at once; the bound is what a new
        # request reaching an engine that only waits for KV may be delayed by. Longer,
        # progressive_idle_wait_s, while every pull out is progressive: the engine then
        # waits for a whole prefill, and each empty step costs CPU the prefill needs.)
        idle_wait_s = (self.settings.progressive_idle_wait_s if meta.only_progressive
                       else self.settings.idle_wait_s)
        # Events the fallback poller took before this step began (it long-polls while
        # the engine is idle, and a local pull can end before the worker wakes for the
        # step that sent it): this step reports them, it has nothing to wait for.
        waiting = (meta.idle and self.book.waiting_on_daemon
                   and not self.cursor.has_new())
        self._idle_wait_s = idle_wait_s if waiting else 0.0
        if self.pump is not None and self.book.waiting_on_daemon:
            self.pump.kick(park_s=self._idle_wait_s)

    @property
    def step_wait_s(self) -> float:
        """How long this step's ``step`` may wait for kvd's events (0: not at all; only a
        step that computes nothing while transfers are out waits)."""
        return self._idle_wait_s

    def step(self, finished_req_ids: set[str]) -> StepReport:
        """End of a step (get_finished): what vLLM must hear now; never blocks."""
        if not self.reports:
            return StepReport()
        self.book.vllm_finished(set(finished_req_ids))
        if self.poller is not None:
            self.poller.note_step(self._now())
        if self.pump is not None:
            self.pump.drain(wait_s=self._idle_wait_s)
            self._idle_wait_s = 0.0
        if self.cursor.restarts != self._restarts_seen:
            self._restarts_seen = self.cursor.restarts
            lost = self.book.daemon_restarted()
            if lost:
                step_log.error("kvd restarted: %d transfers in flight there are lost (pulls "
                               "fail under kv_load_failure_policy; published blocks are freed)",
                               len(lost))
            self.rejoin.kick("a new kvd instance answered")
        for ev in self.cursor.take():
            if ev.kind == "done_sending" and ev.request_id in self._aliases:
                ev = msgspec.structs.replace(ev, request_id=self._aliases.pop(ev.request_id))
            if TRACE.on and ev.kind == "done_recving":
                TRACE.point("event_taken", ev.request_id, ev.duration_s)
            self.book.on_event(ev)
        for rid in self.book.expire(self._now()):
            step_log.error("request %s: kvd never reported its transfer; giving up", rid)
        report = self.book.take()
        if TRACE.on:
            for rid in report.finished_recving:
                TRACE.point("recv_reported", rid)
        return report

    def worker_meta(self) -> WorkerRejoined | None:
        """Once after a re-registration: the new daemon instance (and its peer address)
        for the scheduler's receipts, through vLLM's worker -> scheduler metadata."""
        handle = self.handle
        if not self.reports or handle is None or handle.instance_id == self._announced:
            return None
        self._announced = handle.instance_id
        return WorkerRejoined(peer_address=handle.peer_address,
                             instance_id=handle.instance_id)

    def close(self) -> None:
        self.rejoin.close()
        if self.poller is not None:
            self.poller.close()
            self.poller = None
        if self.pump is not None:
            self.pump.close()
            self.pump = None
        if self.handle is not None:
            with contextlib.suppress(Exception):
                self.client.deregister(self.handle)
            self.handle = None
        self.client.close()


def _pool_addr(handle: RankHandle) -> int:
    pool = handle.pool
    if pool.handle.kind == "cuda_ipc":
        return int(pool.tensor().data_ptr())
    return int(pool.array.ctypes.data)


@contextlib.contextmanager
def _cpu_pool_context(handle: RankHandle) -> Iterator[None]:
    """Serve vLLM's single KV allocation from the shm pool.

    On CPU torch has no allocator hook, and vLLM allocates its whole KV cache
    with one ``torch.zeros(nbytes, dtype=int8)`` inside this context: that one
    call (matched by size and dtype) returns the pool, everything else passes.
    """
    import torch

    nbytes = handle.pool.handle.nbytes
    pool = torch.frombuffer(handle.pool.mm, dtype=torch.int8, count=nbytes)
    real_zeros = torch.zeros
    served = []

    def zeros(*size: Any, **kwargs: Any) -> Any:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        if (not served and kwargs.get("dtype") is torch.int8 and len(shape) == 1
                and int(shape[0]) == nbytes):
            served.append(True)
            pool.zero_()
            return pool
        return real_zeros(*size, **kwargs)

    torch.zeros = zeros  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.zeros = real_zeros  # type: ignore[assignment]
    if not served:
        raise LayoutError(f"vLLM did not allocate its KV cache as one {nbytes}-byte int8 "
                          "buffer inside kvd's context: zero copy impossible with this vLLM")

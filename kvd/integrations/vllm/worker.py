"""Worker side: put vLLM's KV cache inside kvd's pool, check it, report completions.

Runs in each vLLM worker process. Registration happens before vLLM allocates,
so kvd owns the memory NIXL reads and writes (zero copy); afterwards every
layer view is checked against kvd's layout. Only the first rank polls the
daemon: kvd reports per engine, not per rank (get_finished_count is 1).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from kvd.client import KvdClient, RankHandle
from kvd.errors import LayoutError
from kvd.integrations.vllm.metadata import KvdConnectorMetadata, KvdHandshake
from kvd.integrations.vllm.settings import ConnectorSettings
from kvd.integrations.vllm_core.events import EventBook, StepReport
from kvd.integrations.vllm_core.geometry import LayerView, VllmKvGeometry, check_views

log = logging.getLogger("kvd.vllm")


class KvdWorker:
    def __init__(self, settings: ConnectorSettings, geom: VllmKvGeometry,
                 multi_group: bool = False) -> None:
        self.settings = settings
        self.geom = geom
        self.reports = geom.tp_rank == 0 and geom.pp_rank == 0
        self.book = EventBook(multi_group=multi_group)
        self.client = KvdClient(settings.address, token=settings.token,
                                timeout_s=settings.request_timeout_s, on_lost=self._lost)
        self.handle: RankHandle | None = None

    def _lost(self, reason: str) -> None:
        log.error("kvd lost this engine's registration (%s): its KV pool is no longer "
                  "served; restart this vLLM engine to register again", reason)

    # ------------------------------------------------------------ memory

    def register(self) -> RankHandle:
        """Register the rank; kvd allocates a pool of exactly vLLM's KV size."""
        if self.handle is None:
            self.geom.check_allocation()
            g = self.geom
            self.handle = self.client.register(
                self.settings.engine_id, g.model_spec(), g.layout_spec(), tp_rank=g.tp_rank,
                tp_size=g.tp_size, pp_rank=g.pp_rank, pp_size=g.pp_size,
                layer_partition=g.layer_partition)
            log.info("kvd pool %s (%d bytes, %s) registered for engine %s rank %d/%d",
                     self.handle.pool.handle.name, self.handle.pool.handle.nbytes,
                     g.kv_layout, self.settings.engine_id, g.tp_rank, g.pp_rank)
        return self.handle

    def allocation_context(self) -> contextlib.AbstractContextManager:
        handle = self.register()
        if handle.pool.handle.kind == "cuda_ipc":
            from kvd.integrations.vllm.cuda_alloc import cuda_pool_context

            return cuda_pool_context(handle.pool)
        return _cpu_pool_context(handle)

    def check_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        handle = self.register()
        pool = handle.pool.handle
        views = [LayerView(name=name, data_ptr=int(t.data_ptr()), shape=tuple(t.shape),
                           strides_nbytes=tuple(s * t.element_size() for s in t.stride()))
                 for name, t in kv_caches.items()]
        check_views(self.geom, views, _pool_addr(handle), pool.nbytes)

    def handshake(self) -> KvdHandshake:
        handle = self.register()
        return KvdHandshake(peer_address=handle.peer_address, daemon_id=handle.daemon_id)

    # ------------------------------------------------------------ completions

    def on_metadata(self, meta: KvdConnectorMetadata) -> None:
        if not self.reports:
            return
        now_s = time.monotonic()
        for rid, blocks in meta.recv.items():
            self.book.announce_recv(rid, blocks, now_s + self.settings.pull_timeout_s)
        for rid in meta.quiet:
            self.book.announce_quiet(rid)
        for rid, blocks in meta.failed.items():
            self.book.announce_failed_submit(rid, blocks)
        for rid, give_up_s in meta.sent.items():
            self.book.announce_send(rid, now_s + give_up_s)

    def step(self, finished_req_ids: set[str]) -> StepReport:
        if not self.reports:
            return StepReport()
        self.book.vllm_finished(set(finished_req_ids))
        if self.book.waiting_on_daemon:
            try:
                for ev in self.client.poll(self.settings.engine_id, timeout_s=0.0):
                    self.book.on_event(ev)
            except Exception as exc:  # noqa: BLE001 - a dead daemon must not stop the engine
                log.warning("polling kvd failed: %s", exc)
            for rid in self.book.expire(time.monotonic()):
                log.error("request %s: kvd never reported its transfer; giving up", rid)
        return self.book.take()

    def close(self) -> None:
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

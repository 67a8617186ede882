"""``KvdConnector``: vLLM's KV connector API, delegated to the local kvd.

One class because vLLM loads one by name; it holds either the scheduler
half (engine-core process) or the worker half (each worker process) and
forwards to it. Everything with logic lives in the vLLM-free
``kvd.integrations.connector_core`` (scheduler.py, sealing.py, worker.py); what
differs between vLLM versions lives in ``compat``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvd.integrations.connector_core.keepalive import RankKeepalive
from kvd.integrations.connector_core.messages import as_vllm
from kvd.integrations.connector_core.scheduler import KvdScheduler
from kvd.integrations.connector_core.settings import (
    VLLM_QUEUE_SPIN_S,
    ConnectorConfigError,
    ConnectorSettings,
)
from kvd.integrations.connector_core.worker import KvdWorker
from kvd.integrations.vllm import executor_wait
from kvd.integrations.vllm.metadata import KvdConnectorMetadata, KvdHandshake, KvdWorkerMeta
from kvd.integrations.vllm.stats import KvdConnectorStats, KvdPromMetrics, totals_to_dict
from kvd.integrations.vllm.vllm_geometry import (
    geometry_from_vllm,
    group_layout,
    is_multi_group,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvd.vllm")

# The layout kvd asks vLLM for, where the attention backend offers it. BHLNC keeps a
# rank's heads of a block, all layers, in one region: a hetero-TP pull is one
# descriptor per block per source rank. CPU attention takes only LBHNC, and hybrid
# (Mamba) models share each layer's tensor between groups, which needs whole blocks
# contiguous per layer: LBHNC too (kvd.planner.hybrid.layout.HYBRID_KV_LAYOUTS).
DEFAULT_LAYOUT = "BHLNC"
CPU_LAYOUT = "LBHNC"
HYBRID_LAYOUT = "LBHNC"
# CPU engines: vLLM's queue readers spin at most this long per wait (kvd_queue_spin_s):
# steps that come back to back are still caught spinning, an idle engine stops taking
# the CPU its neighbours need (executor_wait)
CPU_QUEUE_SPIN_S = 0.005

SLEEP_REFUSED = ("KvdConnector does not support vLLM sleep mode: kvd owns the KV pool and "
                 "cannot release it while asleep")


def cap_queue_spin(settings: ConnectorSettings) -> float | None:
    """Cap how long this process's vLLM queue readers spin (kvd_queue_spin_s; CPU
    engines CPU_QUEUE_SPIN_S by default, others vLLM's own). Returns the cap in force
    (None: vLLM's own)."""
    spin_s = settings.queue_spin_s
    if spin_s is None:
        from vllm.platforms import current_platform

        spin_s = CPU_QUEUE_SPIN_S if current_platform.device_type == "cpu" else None
    if spin_s is not None and spin_s >= VLLM_QUEUE_SPIN_S:
        spin_s = None
    if spin_s is not None and not executor_wait.install():
        spin_s = None
    executor_wait.cap_spin(spin_s)
    return spin_s


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_vllm(vllm_config.kv_transfer_config)
        if vllm_config.model_config.enable_sleep_mode:  # where vLLM never asks (compat)
            raise ConnectorConfigError(SLEEP_REFUSED)
        self._scheduler: KvdScheduler | None = None
        self._worker: KvdWorker | None = None
        self._invalid: set[int] = set()
        self._quiet = False  # the engine core's queue readers honour quiet_for
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvdScheduler(
                self.settings, vllm_config.cache_config.block_size,
                groups=group_layout(kv_cache_config) if is_multi_group(kv_cache_config)
                else None,
                async_scheduling=bool(getattr(vllm_config.scheduler_config,
                                              "async_scheduling", False)))
            # the engine core waits for workers parked in an empty step in the kernel
            self._quiet = (self.settings.progressive_idle_wait_s > 0
                           and executor_wait.install())
            par = vllm_config.parallel_config
            self._keepalive = RankKeepalive(self.settings, par.tensor_parallel_size,
                                            par.pipeline_parallel_size)
        else:
            from vllm.platforms import current_platform

            if current_platform.device_type == "cuda":
                # At start-up: a shim that cannot build fails here, in one line.
                from kvd.integrations.connector_core.cuda_alloc import build_shim

                build_shim()
            geom = geometry_from_vllm(vllm_config, kv_cache_config, self.settings.model_name)
            self._worker = KvdWorker(self.settings, geom,
                                     multi_group=is_multi_group(kv_cache_config))
        cap_queue_spin(self.settings)

    # ------------------------------------------------------------ class-level

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        extra = (vllm_config.kv_transfer_config.kv_connector_extra_config
                 if vllm_config.kv_transfer_config else {}) or {}
        if extra.get("kvd_kv_layout"):
            return str(extra["kvd_kv_layout"])
        from vllm.platforms import current_platform

        model_config = getattr(vllm_config, "model_config", None)
        if model_config is not None and getattr(model_config, "is_hybrid", False):
            return HYBRID_LAYOUT
        return CPU_LAYOUT if current_platform.device_type == "cpu" else DEFAULT_LAYOUT

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Asked by the versions that check it (compat.HOOKS_BY_VERSION): with
        enable_sleep_mode vLLM then refuses to start ("KvdConnector does not support
        sleep mode."). Where vLLM never asks, __init__ refuses."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KvdConnectorStats | None:
        return KvdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvdPromMetrics:
        return KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished_count(self) -> int | None:
        return 1  # kvd reports each transfer once per engine, from the rank-0 worker

    # ------------------------------------------------------------ worker side

    def get_mem_pool_context(self) -> Any:
        assert self._worker is not None
        return self._worker.allocation_context()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.check_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Called before a sleep or a KV discard (``release_kv_cache_memory``), even
        without enable_sleep_mode, by the versions that have it (compat.HOOKS_BY_VERSION).
        Refuse before vLLM frees or remaps memory that kvd serves to its peers: the
        sleep fails before any memory is touched."""
        raise RuntimeError(SLEEP_REFUSED)

    def restore_kv_caches(self) -> None:
        """Called on wake-up (compat.HOOKS_BY_VERSION): nothing to redo,
        unregister_kv_caches never lets a sleep through, so the rank's registration with
        kvd is intact."""

    def get_handshake_metadata(self) -> Any:
        return as_vllm(self._worker.handshake(), KvdHandshake) if self._worker else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvdConnectorMetadata):
            self._worker.on_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to start: the scheduler queued the pull and kvd writes the blocks."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole requests are loaded before vLLM schedules them (WAITING_FOR_REMOTE_KVS)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save: the KV is already in kvd's pool, read in place."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see save_kv_layer)."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        report = self._worker.step(finished_req_ids)
        self._invalid |= set(report.invalid_block_ids)
        return KVConnectorTransferResults(finished_sending=set(report.finished_sending),
                                          finished_recving=set(report.finished_recving),
                                          failed_recving=set(report.failed_recving))

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self) -> Any:
        """After the daemon restarted and this worker registered again: the new
        instance for the scheduler (once); None otherwise."""
        meta = self._worker.worker_meta() if self._worker is not None else None
        return as_vllm(meta, KvdWorkerMeta) if meta is not None else None

    def get_kv_connector_stats(self) -> KvdConnectorStats | None:
        if self._worker is None or not self._worker.reports:
            return None
        totals = self._worker.book.take_totals()
        return None if totals.is_empty() else KvdConnectorStats(data=totals_to_dict(totals))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
            self._keepalive.close()

    # ------------------------------------------------------------ scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake(metadata)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output each step: a re-registration's new daemon instance."""
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, KvdWorkerMeta):
            self._scheduler.daemon_moved(meta.peer_address, meta.instance_id)
        if self._scheduler is not None:  # spans of the wait for the KV (tracing on only)
            self._scheduler.on_output(connector_output.finished_recving,
                                      getattr(connector_output, "failed_recving", ()))

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        meta = self._scheduler.build_meta(idle=idle, output=scheduler_output)
        if self._quiet:
            executor_wait.quiet_for(self.settings.progressive_idle_wait_s
                                    if meta.only_progressive else 0.0)
        return as_vllm(meta, KvdConnectorMetadata)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid hook (SupportsHMA): one block list per KV-cache group."""
        assert self._scheduler is not None
        return self._scheduler.request_finished_all_groups(request, block_ids)

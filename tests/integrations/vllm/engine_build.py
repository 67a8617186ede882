"""Building scheduler-level engines (``scheduler_support.SimEngine`` and subclasses): the
VllmConfig ``vllm serve`` would build with KvdConnector, vLLM's KV-cache config for one
or several groups, and one worker connector per TP rank serving vLLM's own
``allocate_kv_cache`` from kvd's pool."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import scheduler_support as ss
import torch
from scheduler_support import (
    DTYPE,
    HEAD_DIM,
    LAYER_NAMES,
    NUM_LAYERS,
    SimEngine,
    _ranks_patch,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import init_none_hash

try:  # vLLM 0.33 moved it to kv_cache_planning (same signature)
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import kvd.integrations.vllm.vllm_geometry as vllm_geometry
from kvd.integrations.vllm import KvdConnector

E = TypeVar("E", bound=SimEngine)


def engine_config(engine_id: str, model_dir: Path, kvd_address: str, *, block_size: int,
                  tp_size: int = 1, prefix_caching: bool = True, lease_s: float = 30.0,
                  failure_policy: str = "fail", max_batched_tokens: int = 1024,
                  extra: dict[str, Any] | None = None) -> VllmConfig:
    """The VllmConfig ``vllm serve --kv-transfer-config '{"kv_connector":"KvdConnector",
    ...}'`` would build, with the KV layout resolved as the engine core resolves it (the
    connector asks for LBHNC on CPU, the only layout CPU attention reads)."""
    if not ss._hash_ready:
        init_none_hash(sha256)
        ss._hash_ready = True
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                               dtype="float32", max_model_len=2048, seed=0)
    extra_config = {"kvd_address": kvd_address, "kvd_lease_s": lease_s,
                    "kvd_pull_timeout_s": 30.0, **(extra or {})}
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched_tokens,
                                         max_model_len=2048, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
            kv_role="kv_both", engine_id=engine_id, kv_connector_extra_config=extra_config,
            kv_load_failure_policy=failure_policy),  # type: ignore[arg-type]
        device_config=DeviceConfig("cpu"),
    )
    record_kv_cache_layout(vllm_config.cache_config,
                           KvdConnector.get_required_kvcache_layout(vllm_config) or "LBHNC")
    return vllm_config


def wire_engine(cls: type[E], engine_id: str, vllm_config: VllmConfig,
                kv_cache_config: KVCacheConfig, scheduler: Scheduler, tp_size: int,
                tag: int | None) -> E:
    """One worker-role KvdConnector per TP rank, each serving vLLM's own allocate_kv_cache
    from kvd's pool, then the handshake metadata to the scheduler side.

    Each worker sees its own TP rank while it is built (``vllm_geometry._ranks``
    is patched for that moment): vLLM's distributed state does not exist in the
    test process, so the connector would otherwise see rank 0 everywhere.
    """
    workers: list[KvdConnector] = []
    caches: list[dict[str, torch.Tensor]] = []
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        for rank in range(tp_size):
            real_ranks = vllm_geometry._ranks
            vllm_geometry._ranks = _ranks_patch(rank)  # type: ignore[assignment]
            try:
                conn = KvdConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            finally:
                vllm_geometry._ranks = real_ranks  # type: ignore[assignment]
            workers.append(conn)
            with conn.get_mem_pool_context():
                cache = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
            conn.register_kv_caches(cache)
            caches.append(cache)
        handshake = {rank: w.get_handshake_metadata() for rank, w in enumerate(workers)}
        scheduler.connector.set_xfer_handshake_metadata(handshake)  # type: ignore[union-attr]
    except BaseException:
        for w in workers:
            w.shutdown()
        scheduler.shutdown()
        raise
    engine = cls(engine_id=engine_id, tag=next(ss._tags) if tag is None else tag,
                 vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                 scheduler=scheduler, workers=workers, caches=caches,
                 aggregator=KVOutputAggregator.from_connector(workers[0], tp_size),
                 initial_free=0)
    engine.initial_free = engine.num_free_blocks()
    return engine


def make_engine(name: str, model_dir: Path, kvd_address: str, *, block_size: int = 32,
                num_blocks: int = 24, tp_size: int = 1, lease_s: float = 30.0,
                failure_policy: str = "fail", tag: int | None = None,
                max_batched_tokens: int = 1024, extra: dict[str, Any] | None = None
                ) -> SimEngine:
    """An attention-only engine (one KV-cache group), scheduler and workers in this process."""
    engine_id = f"{name}-{uuid.uuid4().hex[:6]}"
    vllm_config = engine_config(engine_id, model_dir, kvd_address, block_size=block_size,
                                tp_size=tp_size, lease_s=lease_s, failure_policy=failure_policy,
                                max_batched_tokens=max_batched_tokens, extra=extra)
    heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=HEAD_DIM,
                             dtype=DTYPE)
    groups = [KVCacheGroupSpec(list(LAYER_NAMES), spec)]
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, spec.page_size_bytes * NUM_LAYERS * num_blocks)
    assert kv_cache_config.num_blocks == num_blocks, kv_cache_config
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=block_size, log_stats=True)
    return wire_engine(SimEngine, engine_id, vllm_config, kv_cache_config, scheduler, tp_size,
                       tag)


def make_multi_group_engine(cls: type[E], name: str, model_dir: Path, kvd_address: str,
                            specs: Callable[[VllmConfig], dict[str, Any]], *,
                            block_size: int = 32, num_blocks: int = 24, tp_size: int = 1,
                            tag: int | None = None) -> E:
    """An engine whose layers vLLM's hybrid allocator groups (Mamba, sliding window, ...):
    ``specs(vllm_config)`` gives every layer's KVCacheSpec; layers of different groups
    share one tensor per position, as in a real engine. Prefix caching is off (the CPU
    build's Mamba kernels do not support it)."""
    from vllm.v1.core import kv_cache_utils

    engine_id = f"{name}-{uuid.uuid4().hex[:6]}"
    vllm_config = engine_config(engine_id, model_dir, kvd_address, block_size=block_size,
                                tp_size=tp_size, prefix_caching=False)
    layer_specs = specs(vllm_config)
    groups = kv_cache_utils.get_kv_cache_groups(vllm_config, layer_specs)
    page_nbytes = max(s.page_size_bytes for s in layer_specs.values())
    tensors = max(len(g.layer_names) for g in groups)  # one tensor per layer position
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups,
                                                      page_nbytes * tensors * num_blocks)
    assert kv_cache_config.num_blocks == num_blocks, kv_cache_config
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched_bs, hash_bs = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config,
                                                                    vllm_config)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
    return wire_engine(cls, engine_id, vllm_config, kv_cache_config, scheduler, tp_size, tag)

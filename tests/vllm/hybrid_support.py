"""A hybrid (Mamba + attention) engine for scheduler-level tests: vLLM's real Scheduler
with its hybrid allocator, worker-side KvdConnectors and vLLM's own allocate_kv_cache
carving the KV cache out of kvd's pool.

The model is a config-only Nemotron-H of 4 layers ("M*M*": Mamba 0 2, attention
1 3), so vLLM makes two KV-cache groups (Mamba, full attention) sharing one
tensor per layer position, as in a real hybrid engine. The KV specs are the
ones vLLM's model would report (Mamba shapes from NemotronHForCausalLM at this
TP), with the Mamba page padded to the attention page as vLLM's hybrid config
does.

The fake forward pass writes, per rank: attention K and V of the scheduled
tokens (through vLLM's own LBHNC page views, [block][head][token][K||V]) and
the Mamba conv and SSM states of the request's slot
(through vLLM's own Mamba views, as MambaBase.bind_kv_cache unpacks them),
each a pattern of (engine tag, layer, position), so the decode side can check
what it received byte for byte.
"""

from __future__ import annotations

import json
import uuid
from math import prod
from pathlib import Path
from typing import Any

import scheduler_support as ss
import torch
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
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import kvd.integrations.vllm.vllm_geometry as vllm_geometry
from kvd.integrations.vllm import KvdConnector

PATTERN = "M*M*"
MAMBA_LAYERS = (0, 2)
ATTN_LAYERS = (1, 3)
NUM_KV_HEADS = 2
HEAD_DIM = 64
LAYER_NAMES = {i: (f"model.layers.{i}.mixer" if c == "M" else f"model.layers.{i}.mixer.attn")
               for i, c in enumerate(PATTERN)}

MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": len(PATTERN),
    "hybrid_override_pattern": PATTERN,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "expand": 1,
    "chunk_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "layer_norm_epsilon": 1e-5,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "residual_in_fp32": False,
    "rescale_prenorm_residual": True,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    return path


class HybridEngine(ss.SimEngine):
    """SimEngine over the hybrid model: block ids per group, attention and Mamba state."""

    mamba_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def heads_per_rank(self) -> int:
        return NUM_KV_HEADS // self.tp_size

    def group_ids(self, request_id: str) -> list[list[int]]:
        return [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(request_id)]

    def block_ids(self, request_id: str) -> list[int]:  # type: ignore[override]
        return self.group_ids(request_id)  # type: ignore[return-value]

    def group_kind(self, g: int) -> str:
        spec = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec
        return "mamba" if isinstance(spec, MambaSpec) else "attention"

    def attn_view(self, cache: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        """int32 [block, head, token, K|V, dim]: vLLM's LBHNC page with its channel split."""
        v = cache[LAYER_NAMES[layer]].view(torch.int32)
        b, h, n, c = v.shape
        return v.view(b, h, n, 2, c // 2)

    def mamba_views(self, cache: dict[str, torch.Tensor], layer: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) int32 views of every slot, as MambaBase.bind_kv_cache unpacks them."""
        pages = cache[LAYER_NAMES[layer]].squeeze(1).squeeze(1)
        out, offset = [], 0
        for shape in self.mamba_shapes:
            nbytes = prod(shape) * 4
            out.append(pages[:, offset:offset + nbytes].view(torch.int32).view(-1, *shape))
            offset += nbytes
        return out[0], out[1]

    def conv_channels(self, rank: int) -> torch.Tensor:
        """Global conv channels of a rank in its order: its x, B and C slices (each of the
        three sub-projections sharded over TP on its own, as MambaMixer2 shards them)."""
        cfg, t = MODEL_CONFIG, self.tp_size
        d_inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        g, n = cfg["n_groups"], cfg["ssm_state_size"]
        x = torch.arange(rank * d_inner // t, (rank + 1) * d_inner // t)
        g0, g1 = (rank * g // t, (rank + 1) * g // t) if t <= g else (rank * g // t,
                                                                       rank * g // t + 1)
        b = d_inner + torch.arange(g0 * n, g1 * n)
        return torch.cat([x, b, b + g * n])

    def state_pattern(self, tag: int, rank: int, layer: int, part: int, end: int
                      ) -> torch.Tensor:
        """This rank's slice of one global Mamba state (conv: [channel, step] or its
        transpose; SSM: [head, head_dim, d_state]), valued by global index, so that a
        decode rank of another TP size can check what it got from several prefill ranks."""
        shape = self.mamba_shapes[part]
        if part == 1:  # SSM heads shard evenly
            h = shape[0]
            return ss.kv_pattern(tag, 2000 + layer + 100 * end,
                                 torch.arange(rank * h, (rank + 1) * h),
                                 torch.arange(shape[1]), shape[2])
        steps = MODEL_CONFIG["conv_kernel"] - 1
        flat = ss.kv_pattern(tag, 1000 + layer, torch.tensor([end]), self.conv_channels(rank),
                             steps)[0]  # [channel, step]
        return flat if tuple(shape) == tuple(flat.shape) else flat.T.contiguous()

    def mamba_slot(self, groups: list[list[int]]) -> int:
        g = next(i for i in range(len(groups)) if self.group_kind(i) == "mamba")
        return [b for b in groups[g] if b != 0][-1]

    def attn_blocks(self, groups: list[list[int]]) -> list[int]:
        g = next(i for i in range(len(groups)) if self.group_kind(i) == "attention")
        return groups[g]

    def _forward(self, request_id: str, start: int, end: int) -> None:
        self.computed.setdefault(request_id, []).append((start, end))
        groups = self.blocks_seen[request_id] = self.group_ids(request_id)  # type: ignore
        pos, blk, off = ss._slots(self.attn_blocks(groups), self.block_size, start, end)
        slot = self.mamba_slot(groups)
        for rank, cache in enumerate(self.caches):
            heads = self._heads(rank)
            for layer in ATTN_LAYERS:
                view = self.attn_view(cache, layer)
                for kv in range(2):
                    view[blk, :, off, kv, :] = ss.kv_pattern(self.tag, 2 * layer + kv, pos,
                                                             heads, view.shape[-1])
            for layer in MAMBA_LAYERS:
                for part, state in enumerate(self.mamba_views(cache, layer)):
                    state[slot] = self.state_pattern(self.tag, rank, layer, part, end)

    def _zero(self, block_ids: list[int]) -> None:
        for cache in self.caches:
            for name in LAYER_NAMES.values():
                cache[name][block_ids] = 0

    def attn_mismatches(self, blocks: list[int], start: int, end: int, tag: int,
                        caches: list[dict[str, torch.Tensor]]) -> int:
        pos, blk, off = ss._slots(blocks, self.block_size, start, end)
        bad = 0
        for rank, cache in enumerate(caches):
            for layer in ATTN_LAYERS:
                view = self.attn_view(cache, layer)
                for kv in range(2):
                    want = ss.kv_pattern(tag, 2 * layer + kv, pos, self._heads(rank),
                                         view.shape[-1])
                    bad += int((view[blk, :, off, kv, :] != want).sum())
        return bad

    def mamba_mismatches(self, slot: int, tag: int, end: int,
                         caches: list[dict[str, torch.Tensor]]) -> int:
        bad = 0
        for rank, cache in enumerate(caches):
            for layer in MAMBA_LAYERS:
                for part, state in enumerate(self.mamba_views(cache, layer)):
                    want = self.state_pattern(tag, rank, layer, part, end)
                    bad += int((state[slot] != want).sum())
        return bad


def make_hybrid_engine(name: str, model_dir: Path, kvd_address: str, *,
                       num_blocks: int = 24, tp_size: int = 1, block_size: int = 32,
                       tag: int | None = None) -> HybridEngine:
    """A hybrid engine wired as ``vllm serve`` with KvdConnector would wire it."""
    if not ss._hash_ready:
        init_none_hash(sha256)
        ss._hash_ready = True
    engine_id = f"{name}-{uuid.uuid4().hex[:6]}"
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                               dtype="float32", max_model_len=2048, seed=0)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                         max_model_len=2048, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
            kv_role="kv_both", engine_id=engine_id,
            kv_connector_extra_config={"kvd_address": kvd_address, "kvd_lease_s": 30.0,
                                       "kvd_pull_timeout_s": 30.0},
            kv_load_failure_policy="fail"),  # type: ignore[arg-type]
        device_config=DeviceConfig("cpu"),
    )
    record_kv_cache_layout(vllm_config.cache_config,
                           KvdConnector.get_required_kvcache_layout(vllm_config) or "LBHNC")
    heads = NUM_KV_HEADS // tp_size
    att = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=HEAD_DIM,
                            dtype=torch.float32)
    shapes = NemotronHForCausalLM.get_mamba_state_shape_from_config(vllm_config)
    dtypes = NemotronHForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
    mamba = MambaSpec(shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes),
                      block_size=vllm_config.cache_config.mamba_block_size or 2048,
                      page_size_padded=att.page_size_bytes)
    assert mamba.state_content_size_bytes <= att.page_size_bytes
    specs = {LAYER_NAMES[i]: (mamba if c == "M" else att) for i, c in enumerate(PATTERN)}
    groups = kv_cache_utils.get_kv_cache_groups(vllm_config, specs)
    kv_cache_config = ss.get_kv_cache_config_from_groups(
        vllm_config, groups, att.page_size_bytes * 2 * num_blocks)
    assert kv_cache_config.num_blocks == num_blocks, kv_cache_config
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched_bs, hash_bs = kv_cache_utils.resolve_kv_cache_block_sizes(kv_cache_config,
                                                                    vllm_config)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
    workers: list[KvdConnector] = []
    caches: list[dict[str, torch.Tensor]] = []
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        for rank in range(tp_size):
            real_ranks = vllm_geometry._ranks
            vllm_geometry._ranks = ss._ranks_patch(rank)  # type: ignore[assignment]
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
    aggregator = KVOutputAggregator.from_connector(workers[0], tp_size)
    engine = HybridEngine(engine_id=engine_id, tag=next(ss._tags) if tag is None else tag,
                          vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          scheduler=scheduler, workers=workers, caches=caches,
                          aggregator=aggregator, initial_free=0)
    engine.mamba_shapes = tuple(tuple(s) for s in shapes)
    engine.initial_free = engine.num_free_blocks()
    return engine

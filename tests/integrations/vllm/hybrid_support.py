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
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import scheduler_support as ss
import torch
from engine_build import make_multi_group_engine
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

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

@dataclass(frozen=True)
class Family:
    """One hybrid family at scheduler level: its config.json, vLLM model class (whose
    shape calculator gives the Mamba specs) and the cache layer names vLLM 0.32's model
    registers (as a whole engine showed them), in model order."""

    name: str
    config: dict[str, Any]
    model_cls: Any
    attn_names: tuple[str, ...]
    mamba_names: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    mamba_heads: int
    mamba_head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    model_order: tuple[str, ...] = ()  # the names in the model's registration order

    @property
    def names(self) -> tuple[str, ...]:
        return self.attn_names + self.mamba_names


NEMOTRON_H = Family(
    "nemotron_h", MODEL_CONFIG, NemotronHForCausalLM,
    attn_names=(LAYER_NAMES[1], LAYER_NAMES[3]), mamba_names=(LAYER_NAMES[0], LAYER_NAMES[2]),
    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, mamba_heads=8, mamba_head_dim=16,
    n_groups=2, d_state=16, conv_kernel=4, model_order=tuple(LAYER_NAMES.values()))


def transformers_family(name: str) -> Family:
    """A family of tiny_hybrid_models (config from transformers' own class), with vLLM's
    names for its cache layers."""
    from tiny_hybrid_models import make_config
    from vllm.model_executor.models.registry import ModelRegistry

    config = make_config(name).to_dict()
    arch = {"granitemoehybrid": "GraniteMoeHybridForCausalLM",
            "falcon_h1": "FalconH1ForCausalLM", "zamba2": "Zamba2ForCausalLM",
            "mamba2": "Mamba2ForCausalLM"}[name]
    config["architectures"] = [arch]
    cls = ModelRegistry._try_load_model_cls(arch)
    n = config["num_hidden_layers"]
    if name == "granitemoehybrid":
        kinds = config["layer_types"]
        # transformers writes "full_attention" / "linear_attention" (the Mamba layers)
        attn = tuple(f"model.layers.{i}.self_attn.attn" for i in range(n)
                     if kinds[i] in ("attention", "full_attention"))
        mamba = tuple(f"model.layers.{i}.mixer" for i in range(n)
                      if kinds[i] in ("mamba", "linear_attention"))
        order = tuple(sorted(attn + mamba, key=lambda x: int(x.split(".")[2])))
        heads = config["num_key_value_heads"]
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    elif name == "falcon_h1":  # attention and Mamba in every layer; Mamba named past them
        attn = tuple(f"model.layers.{i}.attn" for i in range(n))
        mamba = tuple(f"model.{n + i}.mixer" for i in range(n))
        order = tuple(x for pair in zip(attn, mamba, strict=True) for x in pair)
        heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    elif name == "zamba2":  # Mamba in every layer, one attention cache per hybrid layer
        hybrid = sum(k == "hybrid" for k in config["layers_block_type"])
        attn = tuple(f"model.attn.{j}" for j in range(hybrid))
        mamba = tuple(f"{hybrid + i}.mixer" for i in range(n))
        order = attn + mamba
        heads, head_dim = config["num_key_value_heads"], config["attention_head_dim"]
    else:  # Mamba2: no attention
        attn, mamba = (), tuple(f"backbone.layers.{i}.mixer" for i in range(n))
        order, heads, head_dim = mamba, 1, 64
    m = {k: config[v] for k, v in (
        ("heads", "n_mamba_heads" if name == "zamba2" else
         "num_heads" if name == "mamba2" else "mamba_n_heads"),
        ("head_dim", "mamba_headdim" if name == "zamba2" else
         "head_dim" if name == "mamba2" else "mamba_d_head"),
        ("groups", "mamba_ngroups" if name == "zamba2" else
         "n_groups" if name == "mamba2" else "mamba_n_groups"),
        ("d_state", "state_size" if name == "mamba2" else "mamba_d_state"),
        ("conv", "conv_kernel" if name == "mamba2" else "mamba_d_conv"))}
    return Family(name, config, cls, attn, mamba, heads, head_dim, m["heads"], m["head_dim"],
                  m["groups"], m["d_state"], m["conv"], order)


def write_model_dir(path: Path, family: Family = NEMOTRON_H) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(family.config, indent=2) + "\n")
    return path


class HybridEngine(ss.SimEngine):
    """SimEngine over the hybrid model: block ids per group, attention and Mamba state."""

    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    family: Family = NEMOTRON_H

    @property
    def heads_per_rank(self) -> int:
        return self.family.num_kv_heads // self.tp_size

    def group_ids(self, request_id: str) -> list[list[int]]:
        return [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(request_id)]

    def block_ids(self, request_id: str) -> list[int]:  # type: ignore[override]
        return self.group_ids(request_id)  # type: ignore[return-value]

    def group_kind(self, g: int) -> str:
        spec = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec
        return "mamba" if isinstance(spec, MambaSpec) else "attention"

    def attn_view(self, cache: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        """int32 [block, head, token, K|V, dim]: vLLM's LBHNC page with its channel split."""
        v = cache[self.family.names[layer]].view(torch.int32)
        b, h, n, c = v.shape
        return v.view(b, h, n, 2, c // 2)

    def mamba_views(self, cache: dict[str, torch.Tensor], layer: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) int32 views of every slot, as MambaBase.bind_kv_cache unpacks them."""
        pages = cache[self.family.names[layer]].squeeze(1).squeeze(1)
        out, offset = [], 0
        for shape in self.mamba_shapes:
            nbytes = prod(shape) * 4
            out.append(pages[:, offset:offset + nbytes].view(torch.int32).view(-1, *shape))
            offset += nbytes
        return out[0], out[1]

    def conv_channels(self, rank: int) -> torch.Tensor:
        """Global conv channels of a rank in its order: its x, B and C slices (each of the
        three sub-projections sharded over TP on its own, as MambaMixer2 shards them)."""
        f, t = self.family, self.tp_size
        d_inner = f.mamba_heads * f.mamba_head_dim
        g, n = f.n_groups, f.d_state
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
        steps = self.family.conv_kernel - 1
        flat = ss.kv_pattern(tag, 1000 + layer, torch.tensor([end]), self.conv_channels(rank),
                             steps)[0]  # [channel, step]
        return flat if tuple(shape) == tuple(flat.shape) else flat.T.contiguous()

    @property
    def attn_layers(self) -> range:
        """Pattern numbers of the attention layers (positions in family.names)."""
        return range(len(self.family.attn_names))

    @property
    def mamba_layers(self) -> range:
        return range(len(self.family.attn_names), len(self.family.names))

    def mamba_slot(self, groups: list[list[int]], layer: int | None = None) -> int:
        """The running-state slot of ``layer``'s group (of the first Mamba group if None):
        several Mamba groups (Zamba2) keep a slot each."""
        if layer is None:
            g = next(i for i in range(len(groups)) if self.group_kind(i) == "mamba")
        else:
            name = self.family.names[layer]
            g = next(i for i, grp in enumerate(self.kv_cache_config.kv_cache_groups)
                     if name in grp.layer_names)
        return [b for b in groups[g] if b != 0][-1]

    def attn_blocks(self, groups: list[list[int]]) -> list[int]:
        g = next(i for i in range(len(groups)) if self.group_kind(i) == "attention")
        return groups[g]

    def _forward(self, request_id: str, start: int, end: int) -> None:
        self.computed.setdefault(request_id, []).append((start, end))
        groups = self.blocks_seen[request_id] = self.group_ids(request_id)  # type: ignore
        if self.attn_layers:
            pos, blk, off = ss._slots(self.attn_blocks(groups), self.block_size, start, end)
        for rank, cache in enumerate(self.caches):
            heads = self._heads(rank)
            for layer in self.attn_layers:
                view = self.attn_view(cache, layer)
                for kv in range(2):
                    view[blk, :, off, kv, :] = ss.kv_pattern(self.tag, 2 * layer + kv, pos,
                                                             heads, view.shape[-1])
            for layer in self.mamba_layers:
                slot = self.mamba_slot(groups, layer)
                for part, state in enumerate(self.mamba_views(cache, layer)):
                    state[slot] = self.state_pattern(self.tag, rank, layer, part, end)

    def _zero(self, block_ids: list[int]) -> None:
        for cache in self.caches:
            for name in self.family.names:
                cache[name][block_ids] = 0

    def attn_mismatches(self, blocks: list[int], start: int, end: int, tag: int,
                        caches: list[dict[str, torch.Tensor]]) -> int:
        pos, blk, off = ss._slots(blocks, self.block_size, start, end)
        bad = 0
        for rank, cache in enumerate(caches):
            for layer in self.attn_layers:
                view = self.attn_view(cache, layer)
                for kv in range(2):
                    want = ss.kv_pattern(tag, 2 * layer + kv, pos, self._heads(rank),
                                         view.shape[-1])
                    bad += int((view[blk, :, off, kv, :] != want).sum())
        return bad

    def mamba_mismatches(self, groups: list[list[int]], tag: int, end: int,
                         caches: list[dict[str, torch.Tensor]]) -> int:
        """Wrong elements in every Mamba layer's slot named by ``groups`` (per group)."""
        bad = 0
        for rank, cache in enumerate(caches):
            for layer in self.mamba_layers:
                slot = self.mamba_slot(groups, layer)
                for part, state in enumerate(self.mamba_views(cache, layer)):
                    want = self.state_pattern(tag, rank, layer, part, end)
                    bad += int((state[slot] != want).sum())
        return bad


def make_hybrid_engine(name: str, model_dir: Path, kvd_address: str, *,
                       num_blocks: int = 24, tp_size: int = 1, block_size: int = 32,
                       tag: int | None = None, family: Family = NEMOTRON_H) -> HybridEngine:
    """A hybrid engine wired as ``vllm serve`` with KvdConnector would wire it: the KV specs
    the family's vLLM model class reports at this TP, the Mamba page padded to the
    attention page."""
    shapes: list[tuple[int, ...]] = []

    def specs(vllm_config: Any) -> dict[str, Any]:
        att = FullAttentionSpec(block_size=block_size,
                                num_kv_heads=family.num_kv_heads // tp_size,
                                head_size=family.head_dim, dtype=torch.float32)
        shapes.extend(tuple(s) for s in
                      family.model_cls.get_mamba_state_shape_from_config(vllm_config))
        dtypes = family.model_cls.get_mamba_state_dtype_from_config(vllm_config)
        padded = att.page_size_bytes if family.attn_names else None  # attention-free: none
        mamba = MambaSpec(shapes=tuple(shapes), dtypes=tuple(dtypes),
                          block_size=vllm_config.cache_config.mamba_block_size or 2048,
                          page_size_padded=padded)
        assert padded is None or mamba.state_content_size_bytes <= padded
        return {n: att if n in family.attn_names else mamba for n in family.model_order}

    engine = make_multi_group_engine(HybridEngine, name, model_dir, kvd_address, specs,
                                        block_size=block_size, num_blocks=num_blocks,
                                        tp_size=tp_size, tag=tag)
    engine.mamba_shapes = tuple(shapes)
    engine.family = family
    return engine

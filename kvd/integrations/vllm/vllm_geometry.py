"""Read a vLLM worker's KV cache facts into kvd's plain description.

The only module that knows where vLLM keeps these facts (kv_cache_config,
model and parallel configs, the distributed state); everything it returns is
a plain VllmKvGeometry, checked by vLLM-free code.
"""

from __future__ import annotations

import os
from typing import Any

from kvd.errors import LayoutError
from kvd.integrations.vllm_core.geometry import VllmKvGeometry
from kvd.integrations.vllm_core.hybrid import (
    SPEC_KINDS,
    VllmCacheGroup,
    VllmHybridGeometry,
    VllmMambaConfig,
)


def is_multi_group(kv_cache_config: Any) -> bool:
    return kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1


def _ranks(parallel_config: Any) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this worker."""
    tp_size = parallel_config.tensor_parallel_size
    pp_size = parallel_config.pipeline_parallel_size
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return (ps.get_tensor_model_parallel_rank(), tp_size,
                ps.get_pp_group().rank_in_group, pp_size)
    return 0, tp_size, 0, pp_size


def _layer_order(kv_cache_config: Any) -> tuple[list[str], int]:
    """Layer names in memory order of their block 0, and the one backing size."""
    starts: dict[str, int] = {}
    sizes = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        sizes.add(tensor.size)
        for i, name in enumerate(tensor.layers):
            starts[name] = getattr(tensor, "offset", 0) + i * getattr(tensor, "layer_stride", 0)
    if len(sizes) != 1:
        raise LayoutError(f"vLLM KV cache tensors of several sizes {sorted(sizes)}: kvd "
                          "serves one backing allocation")
    return sorted(starts, key=lambda n: starts[n]), sizes.pop()


def cache_groups(kv_cache_config: Any) -> list[VllmCacheGroup]:
    """vLLM's KV-cache groups as plain values (kvd.integrations.vllm_core.hybrid)."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        out.append(VllmCacheGroup(
            spec_type=kind, layer_names=tuple(group.layer_names),
            sliding_window=int(getattr(spec, "sliding_window", 0) or 0)
            if kind == "SlidingWindowSpec" else 0,
            mamba_shapes=tuple(tuple(int(x) for x in s) for s in getattr(spec, "shapes", ())),
            mamba_dtypes=tuple(str(d) for d in getattr(spec, "dtypes", ()))))
    return out


def group_layout(kv_cache_config: Any) -> list[tuple[str, int]]:
    """(kvd layer kind, block size in tokens) of each group: the scheduler's view."""
    return [(SPEC_KINDS.get(type(g.kv_cache_spec).__name__, "?"), g.kv_cache_spec.block_size)
            for g in kv_cache_config.kv_cache_groups]


def _mamba_config(hf_config: Any) -> VllmMambaConfig | None:
    """Mamba2 geometry from the model config (Nemotron-H / Mamba2 / Zamba2 field names)."""
    get = lambda *names: next((getattr(hf_config, n) for n in names  # noqa: E731
                               if getattr(hf_config, n, None) is not None), None)
    heads = get("mamba_num_heads", "n_mamba_heads", "num_heads")
    head_dim = get("mamba_head_dim", "mamba_headdim", "head_dim")
    d_state = get("ssm_state_size", "mamba_d_state", "state_size")
    kernel = get("conv_kernel", "mamba_d_conv", "mamba_conv_kernel")
    groups = get("n_groups", "mamba_ngroups", "mamba_n_groups")
    if None in (heads, head_dim, d_state, kernel, groups):
        return None
    return VllmMambaConfig(num_heads=int(heads), head_dim=int(head_dim), n_groups=int(groups),
                           d_state=int(d_state), conv_kernel=int(kernel))


def hybrid_geometry_from_vllm(vllm_config: Any, kv_cache_config: Any,
                              model_name: str | None = None) -> VllmHybridGeometry:
    """A multi-group (hybrid) worker: its groups and the one allocation kvd must serve."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    groups = cache_groups(kv_cache_config)
    model_config = vllm_config.model_config
    tp_rank, tp_size, pp_rank, pp_size = _ranks(vllm_config.parallel_config)
    att = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups
           if isinstance(g.kv_cache_spec, AttentionSpec)]
    mla = bool(att) and isinstance(att[0], MLAAttentionSpec)
    sizes = {t.size for t in kv_cache_config.kv_cache_tensors}
    if len(sizes) != 1:
        raise LayoutError(f"vLLM KV cache tensors of several sizes {sorted(sizes)}: kvd "
                          "serves one backing allocation")
    total_layers = model_config.get_total_num_hidden_layers()
    partition = None
    if pp_size > 1:
        from vllm.distributed.utils import get_pp_indices

        partition = tuple(stop - start for start, stop in (
            get_pp_indices(total_layers, r, pp_size) for r in range(pp_size)))
    name = model_name or os.path.basename(str(model_config.served_model_name
                                              or model_config.model).rstrip("/"))
    mamba_specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups
                   if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    conv_layout = "DS"
    mamba = _mamba_config(model_config.hf_config) if mamba_specs else None
    if mamba is not None:
        steps = mamba.conv_kernel - 1
        conv_layout = "SD" if tuple(mamba_specs[0].shapes[0])[0] == steps else "DS"
    return VllmHybridGeometry(
        model_name=name, groups=tuple(groups), num_layers=total_layers,
        total_kv_heads=1 if mla or not att else model_config.get_total_num_kv_heads(),
        head_size=att[0].head_size if att else 1,
        dtype=str(att[0].dtype).removeprefix("torch.") if att else "float32",
        mla=mla, kernel_block_tokens=att[0].block_size if att else 1,
        num_blocks=kv_cache_config.num_blocks, buf_nbytes=sizes.pop(), mamba=mamba,
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        layer_partition=partition, conv_layout=conv_layout,
        kv_layout=vllm_config.cache_config.get_resolved_kv_cache_layout().name)


def geometry_from_vllm(vllm_config: Any, kv_cache_config: Any,
                       model_name: str | None = None) -> VllmKvGeometry | VllmHybridGeometry:
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if kv_cache_config is None:
        raise LayoutError("KvdConnector needs vLLM's kv_cache_config (vLLM 0.32 or newer)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return hybrid_geometry_from_vllm(vllm_config, kv_cache_config, model_name)
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec) or isinstance(spec, SlidingWindowSpec):
        raise LayoutError(f"KV cache spec {type(spec).__name__} is not full attention: not "
                          "supported by kvd's vLLM connector yet")
    mla = isinstance(spec, MLAAttentionSpec)
    model_config = vllm_config.model_config
    tp_rank, tp_size, pp_rank, pp_size = _ranks(vllm_config.parallel_config)
    names, buf_nbytes = _layer_order(kv_cache_config)
    partition = None
    total_layers = len(names)
    if pp_size > 1:
        from vllm.distributed.utils import get_pp_indices

        total_layers = model_config.get_total_num_hidden_layers()
        partition = tuple(stop - start for start, stop in (
            get_pp_indices(total_layers, r, pp_size) for r in range(pp_size)))
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    name = model_name or os.path.basename(str(model_config.served_model_name
                                              or model_config.model).rstrip("/"))
    return VllmKvGeometry(
        model_name=name,
        total_kv_heads=1 if mla else model_config.get_total_num_kv_heads(),
        total_layers=total_layers,
        heads_on_rank=spec.num_kv_heads,
        layer_names=tuple(names),
        head_size=spec.head_size,
        head_size_v=getattr(spec, "head_size_v", spec.head_size),
        dtype=str(spec.dtype).removeprefix("torch."),
        mla=mla,
        block_size_tokens=spec.block_size,
        num_blocks=kv_cache_config.num_blocks,
        kv_layout=layout,
        buf_nbytes=buf_nbytes,
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        layer_partition=partition,
    )

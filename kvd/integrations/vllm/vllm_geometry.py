"""Read a vLLM worker's KV cache facts into kvd's plain description.

The only module that knows where vLLM keeps these facts (kv_cache_config,
model and parallel configs, the distributed state); everything it returns is
a plain VllmKvGeometry, checked by vLLM-free code.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from kvd.errors import LayoutError
from kvd.integrations.connector_core.geometry import VllmKvGeometry
from kvd.integrations.connector_core.hybrid import (
    SPEC_KINDS,
    VllmCacheGroup,
    VllmHybridGeometry,
    VllmMambaConfig,
)


def is_multi_group(kv_cache_config: Any) -> bool:
    """Whether the connector takes vLLM's per-group path (kvd's hybrid geometry): several
    KV-cache groups, or one group of Mamba state (an attention-free Mamba2 model)."""
    if kv_cache_config is None:
        return False
    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 or any(type(g.kv_cache_spec).__name__ == "MambaSpec"
                                  for g in groups)


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
            starts[name] = tensor.offset + i * tensor.layer_stride
    if len(sizes) != 1:
        raise LayoutError(f"vLLM KV cache tensors of several sizes {sorted(sizes)}: kvd "
                          "serves one backing allocation")
    return sorted(starts, key=lambda n: starts[n]), sizes.pop()


def _tensor_order(kv_cache_config: Any) -> dict[str, int]:
    """Each layer's position in its KVCacheTensor (layers[l] starts at l * layer_stride)."""
    return {name: i for tensor in kv_cache_config.kv_cache_tensors
            for i, name in enumerate(tensor.layers)}


def _layer_id(name: str) -> int | None:
    """vLLM's own layer index of a layer name (the one its bind_kv_cache orders by)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return int(extract_layer_index(name))
    except (AssertionError, ValueError):
        return None


def cache_groups(kv_cache_config: Any) -> list[VllmCacheGroup]:
    """vLLM's KV-cache groups as plain values (kvd.integrations.connector_core.hybrid), each
    group's layers in their tensor order."""
    order = _tensor_order(kv_cache_config)
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        names = sorted(group.layer_names, key=lambda n: order.get(n, 0))
        out.append(VllmCacheGroup(
            spec_type=kind, layer_names=tuple(names),
            sliding_window=int(getattr(spec, "sliding_window", 0) or 0)
            if kind == "SlidingWindowSpec" else 0,
            mamba_shapes=tuple(tuple(int(x) for x in s) for s in getattr(spec, "shapes", ())),
            mamba_dtypes=tuple(str(d) for d in getattr(spec, "dtypes", ())),
            layer_ids=tuple(_layer_id(n) for n in names)))
    return out


def group_layout(kv_cache_config: Any) -> list[tuple[str, int]]:
    """(kvd layer kind, block size in tokens) of each group: the scheduler's view."""
    return [(SPEC_KINDS.get(type(g.kv_cache_spec).__name__, "?"), g.kv_cache_spec.block_size)
            for g in kv_cache_config.kv_cache_groups]


def model_class(vllm_config: Any) -> type:
    """The model class vLLM runs (what its own hybrid config asks for shapes)."""
    from vllm.model_executor.models.registry import ModelRegistry

    model_config = vllm_config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture,
                                             model_config=model_config)
    return cls


def _at_tp1(vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` whose parallel config says TP 1."""
    one = copy.copy(vllm_config)
    par = copy.copy(vllm_config.parallel_config)
    object.__setattr__(par, "tensor_parallel_size", 1)
    object.__setattr__(one, "parallel_config", par)
    return one


def mamba_config(vllm_config: Any, mamba_specs: list[Any]) -> VllmMambaConfig:
    """The model's global Mamba2 geometry, from vLLM's own objects.

    vLLM's MambaSpec has only this rank's shapes, and x, B and C are sharded
    separately: how the conv channels split is not in it. vLLM's shape calculator
    for the model class (``get_mamba_state_shape_from_config``, what vLLM's hybrid
    config sizes pages with) at TP 1 gives the global conv (conv_dim, kernel - 1)
    and SSM (heads, head_dim, d_state) shapes; Mamba2 has x = heads * head_dim, so
    B and C are (conv_dim - x) / 2 = n_groups * d_state each. Anything else is
    refused naming the fact and the class; hybrid_spec then checks the rank's own
    MambaSpec shapes against these at the engine's TP.
    """
    cls = model_class(vllm_config)
    name = cls.__name__
    types = sorted({getattr(s.mamba_type, "name", str(s.mamba_type)) for s in mamba_specs})
    if types != ["MAMBA2"]:
        raise LayoutError(f"{name}: vLLM's Mamba state is {'/'.join(types)}; kvd moves "
                          "Mamba2 (MambaMixer2) states only")
    if any(len(s.shapes) != 2 for s in mamba_specs):
        raise LayoutError(f"{name}: vLLM's MambaSpec has {len(mamba_specs[0].shapes)} state "
                          "tensors; kvd moves Mamba2's (conv, ssm) pair only")
    calc = getattr(cls, "get_mamba_state_shape_from_config", None)
    if calc is None:
        raise LayoutError(f"{name} has no get_mamba_state_shape_from_config: kvd cannot "
                          "learn the global Mamba2 state shape")
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, ssm = (tuple(int(x) for x in s) for s in calc(_at_tp1(vllm_config))[:2])
    if len(conv) != 2 or len(ssm) != 3:
        raise LayoutError(f"{name}: vLLM's Mamba2 state shapes at TP 1 are conv {conv} and "
                          "ssm {ssm}, not (conv_dim, steps) and (heads, head_dim, d_state)")
    conv_dim, steps = conv if is_conv_state_dim_first() else conv[::-1]
    heads, head_dim, d_state = ssm
    bc = conv_dim - heads * head_dim
    if bc < 0 or bc % (2 * d_state):
        raise LayoutError(
            f"{name}: cannot split vLLM's conv state of {conv_dim} channels into x = "
            f"{heads} heads x {head_dim} and B, C of n_groups x {d_state}: the x/B/C split "
            "kvd needs for TP slices is unknown")
    return VllmMambaConfig(num_heads=heads, head_dim=head_dim, n_groups=bc // (2 * d_state),
                           d_state=d_state, conv_kernel=steps + 1)


def hybrid_geometry_from_vllm(vllm_config: Any, kv_cache_config: Any,
                              model_name: str | None = None) -> VllmHybridGeometry:
    """A hybrid (or attention-free Mamba) worker: its groups and the one allocation kvd
    must serve."""
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
    mamba = mamba_config(vllm_config, mamba_specs) if mamba_specs else None
    if mamba is not None:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv_layout = "DS" if is_conv_state_dim_first() else "SD"
    return VllmHybridGeometry(
        model_name=name, groups=tuple(groups), num_layers=total_layers,
        total_kv_heads=1 if mla or not att else model_config.get_total_num_kv_heads(),
        head_size=att[0].head_size if att else 1,
        dtype=str(att[0].dtype).removeprefix("torch.") if att else "float32",
        mla=mla, kernel_block_tokens=att[0].block_size if att else 1,
        num_blocks=kv_cache_config.num_blocks, buf_nbytes=sizes.pop(), mamba=mamba,
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        layer_partition=partition, conv_layout=conv_layout,
        kv_layout=vllm_config.cache_config.get_resolved_kv_cache_layout().name,
        model_class=model_class(vllm_config).__name__)


def geometry_from_vllm(vllm_config: Any, kv_cache_config: Any,
                       model_name: str | None = None) -> VllmKvGeometry | VllmHybridGeometry:
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if kv_cache_config is None:
        raise LayoutError("KvdConnector needs vLLM's kv_cache_config (vLLM passes it to "
                          "every connector it makes with three arguments)")
    groups = kv_cache_config.kv_cache_groups
    if is_multi_group(kv_cache_config):
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
        head_size_v=spec.head_size_v,
        dtype=str(spec.dtype).removeprefix("torch."),
        mla=mla,
        block_size_tokens=spec.block_size,
        num_blocks=kv_cache_config.num_blocks,
        kv_layout=layout,
        buf_nbytes=buf_nbytes,
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
        layer_partition=partition,
    )

"""vLLM's KV-cache groups, described to kvd as a hybrid model (plain values, no vLLM).

vLLM's hybrid allocator hands the connector a KVCacheConfig: groups of layer
names, each with one KVCacheSpec (FullAttentionSpec, SlidingWindowSpec,
MambaSpec, ...). A request's ``block_ids`` has one list per group in that
order, so kvd's HybridSpec keeps the groups in vLLM's order. vLLM's MambaSpec
gives only this rank's state shapes; the global shapes kvd plans with (SSM
heads, head_dim, groups, d_state, kernel) come from the model config, and the
rank's shapes must agree with them at this TP size, or kvd would move other
bytes than the engine keeps: refused here, at startup, naming the shape.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.errors import LayoutError
from kvd.protocol import HybridSpec, LayerSpec, MambaSpecMsg

# vLLM KVCacheSpec class name -> kvd layer kind
SPEC_KINDS = {
    "FullAttentionSpec": "attention",
    "MLAAttentionSpec": "attention",
    "SlidingWindowSpec": "sliding",
    "MambaSpec": "mamba",
}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class VllmCacheGroup:
    """One of vLLM's KV-cache groups: its spec's class name, layers and the fields kvd uses."""

    spec_type: str
    layer_names: tuple[str, ...]
    sliding_window: int = 0  # SlidingWindowSpec.sliding_window (tokens)
    mamba_shapes: tuple[tuple[int, ...], ...] = ()  # MambaSpec.shapes: this rank's (conv, ssm)
    mamba_dtypes: tuple[str, ...] = ()  # MambaSpec.dtypes, e.g. "torch.bfloat16"


@dataclass(frozen=True)
class VllmMambaConfig:
    """The model config's global Mamba2 geometry (e.g. Nemotron-H's mamba_* fields)."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int


def layer_index(name: str) -> int:
    """vLLM's layer names carry the global index: "model.layers.12.mixer" -> 12."""
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise LayoutError(f"cannot find a layer index in vLLM layer name {name!r}")
    return int(match.group(1))


def _dtype(name: str) -> str:
    return name.removeprefix("torch.")


def _conv_layout(group: VllmCacheGroup, mamba: VllmMambaConfig, tp_size: int,
                 prefer: str) -> tuple[str, str, str]:
    """(conv layout, conv dtype, ssm dtype), after checking the rank's shapes."""
    if len(group.mamba_shapes) != 2 or len(group.mamba_dtypes) != 2:
        raise LayoutError(f"Mamba group {group.layer_names[:2]}: expected (conv, ssm) shapes "
                          f"and dtypes, got {group.mamba_shapes} / {group.mamba_dtypes}")
    t, h, g = tp_size, mamba.num_heads, mamba.n_groups
    if h % t or (g and g % t and t % g):
        raise LayoutError(f"TP {t} cannot shard {h} SSM heads and {g} Mamba groups")
    groups_here = (g // t if t <= g else 1) if g else 0
    channels = h // t * mamba.head_dim + 2 * groups_here * mamba.d_state
    steps = mamba.conv_kernel - 1
    conv, ssm = (tuple(s) for s in group.mamba_shapes)
    want_ssm = (h // t, mamba.head_dim, mamba.d_state)
    if ssm != want_ssm:
        raise LayoutError(f"vLLM's SSM state shape {ssm} at TP {t} is not (heads, head_dim, "
                          f"d_state) = {want_ssm} from the model config")
    layouts = [name for name, shape in (("DS", (channels, steps)), ("SD", (steps, channels)))
               if conv == shape]
    if not layouts:
        raise LayoutError(f"vLLM's conv state shape {conv} at TP {t} is neither (conv_dim, "
                          f"state_len) = {(channels, steps)} nor its transpose")
    layout = prefer if prefer in layouts else layouts[0]
    return layout, _dtype(group.mamba_dtypes[0]), _dtype(group.mamba_dtypes[1])


def hybrid_spec(groups: Sequence[VllmCacheGroup], num_layers: int, tp_size: int,
                mamba: VllmMambaConfig | None = None, prefer_conv_layout: str = "DS"
                ) -> HybridSpec:
    """kvd's description of vLLM's groups, in vLLM's group order.

    ``num_layers``: every layer of the model (MLP/MoE layers have no cache and become
    ``none``; they still count for PP partitions).
    """
    kinds: dict[int, LayerSpec] = {}
    out_groups: list[list[int]] = []
    conv: tuple[str, str, str] | None = None
    for group in groups:
        kind = SPEC_KINDS.get(group.spec_type)
        if kind is None:
            raise LayoutError(f"vLLM KV-cache spec {group.spec_type} is not supported by kvd "
                              f"(supported: {', '.join(SPEC_KINDS)})")
        if not group.layer_names:
            raise LayoutError(f"vLLM KV-cache group of {group.spec_type} has no layers")
        if kind == "mamba":
            if mamba is None:
                raise LayoutError("vLLM has Mamba layers but no Mamba config was given")
            found = _conv_layout(group, mamba, tp_size, prefer_conv_layout)
            if conv is not None and found != conv:
                raise LayoutError(f"Mamba groups disagree on the state: {conv} vs {found}")
            conv = found
        layer = LayerSpec(kind, group.sliding_window if kind == "sliding" else 0)
        ids = sorted(layer_index(n) for n in group.layer_names)
        for i in ids:
            if not 0 <= i < num_layers:
                raise LayoutError(f"vLLM layer {i} outside the model's {num_layers} layers")
            if i in kinds:
                raise LayoutError(f"vLLM layer {i} is in two KV-cache groups")
            kinds[i] = layer
        out_groups.append(ids)
    msg = None
    if conv is not None and mamba is not None:
        msg = MambaSpecMsg(num_heads=mamba.num_heads, head_dim=mamba.head_dim,
                           n_groups=mamba.n_groups, d_state=mamba.d_state,
                           conv_kernel=mamba.conv_kernel, conv_dtype=conv[1],
                           ssm_dtype=conv[2])
    return HybridSpec(layers=[kinds.get(i, LayerSpec("none")) for i in range(num_layers)],
                      groups=out_groups, mamba=msg,
                      conv_layout="SD" if conv is not None and conv[0] == "SD" else "DS")

"""vLLM's KV-cache groups, described to kvd as a hybrid model (plain values, no vLLM).

vLLM's hybrid allocator hands the connector a KVCacheConfig: groups of layer
names, each with one KVCacheSpec (FullAttentionSpec, SlidingWindowSpec,
MambaSpec, ...). A request's ``block_ids`` has one list per group in that
order, so kvd's HybridSpec keeps the groups in vLLM's order. vLLM's MambaSpec
gives only this rank's state shapes; the global shapes kvd plans with (SSM
heads, head_dim, groups, d_state, kernel) come from vLLM's own shape calculator
for the model class at TP 1 (kvd.integrations.vllm.vllm_geometry), and the
rank's shapes must agree with them at this TP size, or kvd would move other
bytes than the engine keeps: refused here, at startup, naming the shape.

Layer numbers come from vLLM's allocation, not from a naming convention: each
group lists its layers in the order of its KVCacheTensor (layer l of every
group shares tensor position l). Where vLLM's own ``extract_layer_index`` gives
every cache layer a distinct model layer (Nemotron-H, Granite 4.0-H, Mamba2:
"model.layers.12.mixer" -> 12), kvd numbers layers by it, so that layers without
a cache still count for PP stages. Where it does not (Falcon-H1 puts attention
and Mamba in one layer and names the Mamba "model.3.mixer"; Zamba2's shared
attention is "model.attn.0"), kvd numbers the cache layers themselves in
allocation order (position-major, groups in vLLM's order): one number per cache
layer, stable across TP sizes, and such models run with PP 1 only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvd.errors import LayoutError
from kvd.wire.protocol import HybridSpec, LayerSpec, MambaSpecMsg

# vLLM KVCacheSpec class name -> kvd layer kind
SPEC_KINDS = {
    "FullAttentionSpec": "attention",
    "MLAAttentionSpec": "attention",
    "SlidingWindowSpec": "sliding",
    "MambaSpec": "mamba",
}


@dataclass(frozen=True)
class VllmCacheGroup:
    """One of vLLM's KV-cache groups: its spec's class name, layers and the fields kvd uses."""

    spec_type: str
    layer_names: tuple[str, ...]  # in the group's KVCacheTensor order (tensor position)
    sliding_window: int = 0  # SlidingWindowSpec.sliding_window (tokens)
    mamba_shapes: tuple[tuple[int, ...], ...] = ()  # MambaSpec.shapes: this rank's (conv, ssm)
    mamba_dtypes: tuple[str, ...] = ()  # MambaSpec.dtypes, e.g. "torch.bfloat16"
    # vLLM's extract_layer_index of each name (None where it finds no single index)
    layer_ids: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class VllmMambaConfig:
    """The model's global Mamba2 geometry (vLLM's shape calculator for the class at TP 1)."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int


def layer_numbering(groups: Sequence[VllmCacheGroup], model_layers: int
                    ) -> tuple[dict[str, int], int, bool]:
    """(kvd layer number of every cache layer name, kvd's layer count, numbered by model layer).

    Model layer numbers (vLLM's extract_layer_index) where they are distinct, inside
    the model's ``model_layers`` and ascending in every group's tensor order;
    otherwise the cache layers in allocation order (see the module docstring).
    """
    names = [n for g in groups for n in g.layer_names]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise LayoutError(f"vLLM layer {dup[0]!r} is in two KV-cache groups")
    ids = [i for g in groups for i in (g.layer_ids or (None,) * len(g.layer_names))]
    by_model = (None not in ids and len(set(ids)) == len(ids)
                and all(0 <= int(i) < model_layers for i in ids if i is not None)
                and all(list(g.layer_ids) == sorted(g.layer_ids) for g in groups))
    if by_model:
        return ({n: int(i) for n, i in zip(names, ids, strict=True) if i is not None},
                model_layers, True)
    out: dict[str, int] = {}
    for position in range(max((len(g.layer_names) for g in groups), default=0)):
        for g in groups:
            if position < len(g.layer_names):
                out[g.layer_names[position]] = len(out)
    return out, len(out), False


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

    ``num_layers``: every layer of the model; where vLLM's layer indices number the
    cache layers (layer_numbering), MLP/MoE layers have no cache and become ``none``
    and still count for PP partitions; otherwise kvd's layers are the cache layers.
    """
    numbers, total, _ = layer_numbering(groups, num_layers)
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
        ids = [numbers[n] for n in group.layer_names]
        for i in ids:
            kinds[i] = layer
        out_groups.append(ids)
    msg = None
    if conv is not None and mamba is not None:
        msg = MambaSpecMsg(num_heads=mamba.num_heads, head_dim=mamba.head_dim,
                           n_groups=mamba.n_groups, d_state=mamba.d_state,
                           conv_kernel=mamba.conv_kernel, conv_dtype=conv[1],
                           ssm_dtype=conv[2])
    return HybridSpec(layers=[kinds.get(i, LayerSpec("none")) for i in range(total)],
                      groups=out_groups, mamba=msg,
                      conv_layout="SD" if conv is not None and conv[0] == "SD" else "DS")


# ---------------------------------------------------------------- block lists

NULL_BLOCK_ID = 0  # vLLM's null block (BlockPool.null_block): padding, never written


def one_token_short(groups: Sequence[tuple[str, int]] | None) -> bool:
    """Mamba and sliding-window models: the prefill computes the prompt one token short
    (``KvdScheduler.on_new_request``), and the decode loads that many."""
    return groups is not None and any(kind in ("mamba", "sliding") for kind, _ in groups)


def publish_groups(kinds: Sequence[str], block_ids: Sequence[Sequence[int]],
                   num_tokens: int, block_sizes: Sequence[int]) -> list[list[int]]:
    """The prefill's lists to publish, one per group (vLLM's ``request_finished_all_groups``).

    Full attention: the blocks holding tokens [0, num_tokens). Sliding window:
    the same, without the null blocks vLLM put where the window has passed
    (kvd pairs a group's lists by their last blocks). Mamba: the one slot
    holding the running state (the last non-null block), as NIXL clips it.
    """
    if len(kinds) != len(block_ids) or len(kinds) != len(block_sizes):
        raise LayoutError(f"{len(block_ids)} block-id lists for {len(kinds)} KV-cache groups")
    out = []
    for kind, ids, bs in zip(kinds, block_ids, block_sizes, strict=True):
        real = [int(b) for b in ids]
        if kind == "mamba":
            real = [b for b in real if b != NULL_BLOCK_ID][-1:]
        else:
            real = real[:-(-num_tokens // bs)]
            if kind == "sliding":
                real = [b for b in real if b != NULL_BLOCK_ID]
        out.append(real)
    return out


def pull_groups(kinds: Sequence[str], new_block_ids: Sequence[Sequence[int]],
                num_tokens: int, hit_tokens: int, block_sizes: Sequence[int]
                ) -> list[list[int]]:
    """The decode's lists that receive a pull, one per group.

    ``new_block_ids``: vLLM's ``get_unhashed_block_ids_all_groups()`` (null
    padding already dropped). Token groups keep the blocks of tokens
    [hit_tokens, num_tokens) (vLLM may allocate one more for the first decoded
    token); a sliding group whose leading blocks are padding keeps what is left
    (its tail). Mamba groups keep the slot that will hold the running state.
    """
    if len(kinds) != len(new_block_ids) or len(kinds) != len(block_sizes):
        raise LayoutError(f"{len(new_block_ids)} block-id lists for {len(kinds)} KV-cache "
                          "groups")
    out = []
    for kind, ids, bs in zip(kinds, new_block_ids, block_sizes, strict=True):
        ids = [int(b) for b in ids]
        if kind == "mamba":
            out.append(ids[-1:])
            continue
        if hit_tokens % bs:
            raise LayoutError(f"local prefix hit of {hit_tokens} tokens is not a multiple of "
                              f"the group's block size {bs}")
        need = max(-(-num_tokens // bs) - hit_tokens // bs, 0)
        if kind != "sliding" and need > len(ids):
            raise LayoutError(f"{len(ids)} new blocks cannot hold the {need} blocks of tokens "
                              f"[{hit_tokens}, {num_tokens})")
        out.append(ids[:need])
    return out


# ---------------------------------------------------------------- the rank's pool


def check_hybrid_views(spec: Any, layout: Any, tp_size: int, pp_size: int, pp_rank: int,
                       views: Sequence[Any], pool_addr: int, pool_nbytes: int,
                       layer_partition: tuple[int, ...] | None = None,
                       layer_numbers: Mapping[str, int] | None = None) -> None:
    """Every vLLM view of a hybrid rank lies where kvd's hybrid layout puts it.

    ``views``: LayerView (kvd.integrations.connector_core.geometry) of every cache
    layer, named with the global layer index. Attention views are
    [block, head, token, K||V channel] pages (LBHNC; [block, token, head, ..] for
    LBNHC); Mamba views are vLLM's raw
    [block, 1, 1, bytes] int8 pages holding [conv | ssm]. Raises LayoutError naming
    the first layer and the axis that differ.
    """
    from kvd.planner.hybrid.layout import AttentionGroupLayout, vllm_rank_layout
    from kvd.planner.hybrid.mamba_layout import MambaStateLayout
    from kvd.planner.hybrid.plan import stage_ranges
    from kvd.planner.layout import VLLM_LAYOUTS
    from kvd.planner.topology import Parallelism
    from kvd.pool.geometry import hybrid_model

    if layout.kv_layout not in VLLM_LAYOUTS:
        raise LayoutError(f"vLLM's attention pages are one of vLLM's layouts, not "
                          f"{layout.kv_layout!r}")
    model = hybrid_model(spec)
    par = Parallelism(tp_size, pp_size, layer_partition)
    lay = vllm_rank_layout(model, par, pp_rank, layout.num_blocks, layout.block_size_tokens,
                           spec.hybrid.conv_layout, layout.kv_layout)
    first, stop = stage_ranges(model, par)[pp_rank]
    where: dict[int, tuple[Any, int]] = {}  # global layer -> (group layout, position)
    for g, group in enumerate(model.groups):
        here = [i for i in group.layers if first <= i < stop]
        for j, i in enumerate(here):
            where[i] = (lay.groups[g], j)
    seen = set()
    if layer_numbers is None:
        raise LayoutError("check_hybrid_views needs kvd's layer number of each vLLM layer")
    for view in views:
        i = layer_numbers.get(view.name, -1)
        if i not in where:
            raise LayoutError(f"vLLM layer {view.name!r} has a cache view but kvd's hybrid "
                              f"description has no cache layer {i} on this rank")
        seen.add(i)
        group, j = where[i]
        offset = view.data_ptr - pool_addr
        if not 0 <= offset < pool_nbytes:
            raise LayoutError(f"layer {view.name!r} view at {view.data_ptr:#x} lies outside "
                              f"kvd's pool [{pool_addr:#x}, +{pool_nbytes}): vLLM did not "
                              "allocate its KV cache from the pool (zero copy is off)")
        if isinstance(group, AttentionGroupLayout):
            c = group.cache
            s = c.strides_nbytes()
            e = c.dtype_nbytes
            want_offset = group.base_offset_nbytes + j * s["layer"]
            # vLLM's page axes in the layout's order after L: block, then H and N as named
            axes = [a for a in c.kv_layout[1:-1]]
            sizes = {"B": c.num_blocks, "H": c.num_heads, "N": c.block_size_tokens}
            names = {"B": "block", "H": "head", "N": "token"}
            want = (*(sizes[a] for a in axes), c.kv_parts * c.head_dim)
            want_strides = (*(s[names[a]] for a in axes), e)
            if offset != want_offset:
                raise LayoutError(f"attention layer {view.name!r} starts at pool offset "
                                  f"{offset}, kvd's hybrid layout puts it at {want_offset}")
            if tuple(view.shape) != want or tuple(view.strides_nbytes) != want_strides:
                raise LayoutError(
                    f"attention layer {view.name!r}: vLLM's page is shape {tuple(view.shape)} "
                    f"byte strides {tuple(view.strides_nbytes)}; kvd's hybrid layout "
                    f"{c.kv_layout} ([{', '.join(names[a] for a in axes)}, K||V channel]) has "
                    f"{want} / {want_strides}: K and V are not where kvd reads them")
        elif isinstance(group, MambaStateLayout):
            want_offset = group.base_offset_nbytes + j * group.layer_stride
            extent = group.state_extent_nbytes
            if offset != want_offset:
                raise LayoutError(f"Mamba layer {view.name!r} starts at pool offset {offset}, "
                                  f"kvd's hybrid layout puts it at {want_offset}")
            if (view.shape[0] < group.num_blocks or view.strides_nbytes[0] != group.slot_stride
                    or view.shape[-1] < extent):
                raise LayoutError(
                    f"Mamba layer {view.name!r}: vLLM's state pages are {tuple(view.shape)} "
                    f"with a {view.strides_nbytes[0]} B slot stride; kvd's hybrid layout has "
                    f"{group.num_blocks} slots of {group.slot_stride} B holding "
                    f"[conv | ssm] = {extent} B")
    missing = sorted(set(where) - seen)
    if missing:
        raise LayoutError(f"vLLM registered no cache view for layers {missing[:4]}")


@dataclass(frozen=True)
class VllmHybridGeometry:
    """One hybrid vLLM worker's facts (plain values): what kvd registers and checks."""

    model_name: str
    groups: tuple[VllmCacheGroup, ...]
    num_layers: int
    total_kv_heads: int
    head_size: int
    dtype: str
    mla: bool
    kernel_block_tokens: int  # attention groups' page size in tokens
    num_blocks: int
    buf_nbytes: int
    mamba: VllmMambaConfig | None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    conv_layout: str = "DS"
    kv_layout: str = "LBHNC"  # the attention backend's page order (vLLM's resolved layout)
    model_class: str = ""  # vLLM's model class, for messages

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(SPEC_KINDS.get(g.spec_type, "?") for g in self.groups)

    @property
    def layer_numbers(self) -> dict[str, int]:
        """kvd's layer number of every vLLM cache layer name (layer_numbering)."""
        return layer_numbering(self.groups, self.num_layers)[0]

    def validate(self) -> None:
        """Refuse PP where vLLM's names give no model layer (kvd cannot place the stages)."""
        numbers, _, by_model = layer_numbering(self.groups, self.num_layers)
        if self.pp_size > 1 and not by_model:
            example = next(iter(numbers), "?")
            raise LayoutError(
                f"{self.model_class or self.model_name}: vLLM's cache layer names (e.g. "
                f"{example!r}) give no model layer index, so kvd cannot tell which PP stage "
                f"holds each; run it with pipeline_parallel_size 1 (got {self.pp_size})")

    def model_spec(self) -> Any:
        from kvd.wire.protocol import ModelSpec

        hybrid = hybrid_spec(self.groups, self.num_layers, self.tp_size, self.mamba,
                             self.conv_layout)
        return ModelSpec(name=self.model_name, num_kv_heads=self.total_kv_heads,
                         num_layers=len(hybrid.layers), head_dim=self.head_size,
                         dtype=self.dtype, mla=self.mla, hybrid=hybrid)

    def layout_spec(self) -> Any:
        from kvd.planner.hybrid.layout import hybrid_head_layout
        from kvd.wire.protocol import LayoutSpec

        return LayoutSpec(num_blocks=self.num_blocks, block_size_tokens=self.kernel_block_tokens,
                          kv_layout=self.kv_layout,
                          head_layout=hybrid_head_layout(self.kv_layout))

    def check_allocation(self) -> None:
        """vLLM's one allocation must be exactly kvd's hybrid pool for this rank."""
        from kvd.planner.topology import Parallelism
        from kvd.pool.geometry import hybrid_rank_pool

        self.validate()
        par = Parallelism(self.tp_size, self.pp_size, self.layer_partition)
        pool, _ = hybrid_rank_pool(self.model_spec(), self.layout_spec(), par, self.pp_rank)
        if pool.total_nbytes != self.buf_nbytes:
            raise LayoutError(
                f"vLLM allocates {self.buf_nbytes} bytes of hybrid KV cache but kvd's hybrid "
                f"pool for {self.num_blocks} blocks of {self.kernel_block_tokens} tokens "
                f"(groups {list(self.kinds)}) is {pool.total_nbytes} bytes (padding, a "
                "kernel block split or another arrangement of the groups)")

"""vLLM's KV cache, described to kvd, and the check that vLLM really uses kvd's pool.

The worker registers its rank before vLLM allocates: kvd must size the pool
exactly as vLLM would (one backing allocation of ``buf_nbytes``), and after
vLLM has carved its per-layer views out of it, every view must sit where
kvd's layout says, or kvd would read other bytes than the engine wrote. Both
checks fail at startup with a message naming the mismatch, never later with
wrong tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.errors import LayoutError
from kvd.planner.layout import CacheLayout, vllm_head_layout
from kvd.wire.protocol import DTYPE_NBYTES, LayoutSpec, ModelSpec

# kvd's dtype names are torch's, without the "torch." prefix.
SUPPORTED_DTYPES = tuple(DTYPE_NBYTES)


@dataclass(frozen=True)
class VllmKvGeometry:
    """The facts of one vLLM worker's KV cache that kvd needs (plain values, no vLLM)."""

    model_name: str
    total_kv_heads: int  # the model's KV heads (before TP)
    total_layers: int  # attention layers of the whole model (all PP stages)
    heads_on_rank: int
    layer_names: tuple[str, ...]  # this rank's layers, in the allocation's L order
    head_size: int
    head_size_v: int
    dtype: str
    mla: bool
    block_size_tokens: int
    num_blocks: int
    kv_layout: str  # vLLM's KVCacheLayout name in effect
    buf_nbytes: int  # vLLM's one backing allocation
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None

    def validate(self) -> None:
        if self.dtype not in DTYPE_NBYTES:
            raise LayoutError(f"KV cache dtype {self.dtype} is not supported by kvd "
                              f"(supported: {', '.join(SUPPORTED_DTYPES)})")
        if not self.mla and self.head_size_v != self.head_size:
            raise LayoutError(f"K head size {self.head_size} != V head size "
                              f"{self.head_size_v}: kvd needs equal K and V head sizes")
        if self.mla and self.head_size_v not in (0, self.head_size):
            raise LayoutError(f"MLA cache with a separate V of {self.head_size_v} elements")

    def model_spec(self) -> ModelSpec:
        return ModelSpec(name=self.model_name, num_kv_heads=self.total_kv_heads,
                         num_layers=self.total_layers, head_dim=self.head_size,
                         dtype=self.dtype, mla=self.mla)

    def layout_spec(self) -> LayoutSpec:
        return LayoutSpec(num_blocks=self.num_blocks, block_size_tokens=self.block_size_tokens,
                          kv_layout=self.kv_layout, head_layout=vllm_head_layout(self.kv_layout))

    def cache_layout(self) -> CacheLayout:
        """kvd's byte layout of this rank's pool (what the daemon allocates)."""
        layout = CacheLayout(num_layers=len(self.layer_names), num_blocks=self.num_blocks,
                             block_size_tokens=self.block_size_tokens,
                             num_heads=self.heads_on_rank, head_dim=self.head_size,
                             dtype_nbytes=DTYPE_NBYTES[self.dtype],
                             kv_layout=self.kv_layout,
                             head_layout=vllm_head_layout(self.kv_layout), mla=self.mla)
        layout.validate()
        return layout

    def check_allocation(self) -> None:
        """vLLM's one allocation must be exactly the pool kvd will allocate."""
        self.validate()
        pool_nbytes = self.cache_layout().total_nbytes
        if pool_nbytes != self.buf_nbytes:
            raise LayoutError(
                f"vLLM allocates {self.buf_nbytes} bytes of KV cache but kvd's {self.kv_layout} "
                f"pool for {len(self.layer_names)} layers x {self.num_blocks} blocks x "
                f"{self.heads_on_rank} heads x {self.block_size_tokens} tokens x "
                f"{self.head_size} dims is {pool_nbytes} bytes (padding or an unsupported "
                "KV cache arrangement)")


@dataclass(frozen=True)
class LayerView:
    """One of vLLM's per-layer KV views: [block, head, token, channel] in elements."""

    name: str
    data_ptr: int
    shape: tuple[int, ...]
    strides_nbytes: tuple[int, ...]


def check_views(geom: VllmKvGeometry, views: Sequence[LayerView], pool_addr: int,
                pool_nbytes: int) -> None:
    """Every layer view lies inside the pool where kvd's layout puts it, with its strides."""
    cache = geom.cache_layout()
    s = cache.strides_nbytes()
    names = list(geom.layer_names)
    channel = cache.kv_parts * cache.head_dim
    want_shape = (cache.num_blocks, cache.num_heads, cache.block_size_tokens, channel)
    want_strides = (s["block"], s["head"], s["token"], cache.dtype_nbytes)
    seen = set()
    for view in views:
        if view.name not in names:
            raise LayoutError(f"vLLM layer {view.name!r} has a KV view but kvd was told "
                              f"only of layers {names[:4]}...")
        index = names.index(view.name)
        seen.add(view.name)
        offset = view.data_ptr - pool_addr
        want_offset = index * s["layer"]
        if not 0 <= offset < pool_nbytes:
            raise LayoutError(f"layer {view.name!r} KV view at {view.data_ptr:#x} lies outside "
                              f"kvd's pool [{pool_addr:#x}, +{pool_nbytes}): vLLM did not "
                              "allocate its KV cache from the pool (zero copy is off)")
        if offset != want_offset:
            raise LayoutError(f"layer {view.name!r} starts at pool offset {offset}, kvd's "
                              f"{geom.kv_layout} layout puts it at {want_offset}")
        if tuple(view.shape) != want_shape:
            raise LayoutError(f"layer {view.name!r} KV view has shape {tuple(view.shape)}, "
                              f"kvd expects [block, head, token, channel] = {want_shape}")
        if tuple(view.strides_nbytes) != want_strides:
            raise LayoutError(f"layer {view.name!r} KV view has byte strides "
                              f"{tuple(view.strides_nbytes)}, kvd's {geom.kv_layout} layout has "
                              f"{want_strides} (block, head, token, element)")
    missing = [n for n in names if n not in seen]
    if missing:
        raise LayoutError(f"vLLM registered no KV view for layers {missing[:4]}")

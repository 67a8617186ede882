"""The one adapter from an engine's wire specs to the planner's structs, and its pool.

Plain attention and MLA: `geometry`, `parallelism` and `rank_layout` (a rank's
CacheLayout). Hybrid engines: their ModelSpec as the planner's `HybridModel`
(`hybrid_model`, `hybrid_compat`, `hybrid_rank_layout`) and their pool
(`hybrid_rank_pool`). The daemon (kvd.daemon.engines.table), the connector and the
benchmarks all take geometry from here, so every side sizes a pool alike. The daemon's
checks and pull assembly for hybrid requests are in ``kvd.daemon.hybrid``. A hybrid
rank's pool is
vLLM's hybrid layout (``vllm_rank_layout``: one tensor per layer position shared by
every group, attention pages in the engine's layout (vLLM's LBHNC or LBNHC, or kvd's
blocks_first), Mamba slots of the engine's own pages-per-logical-block ratio), sized
by its end.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import msgspec

from kvd.errors import KvdError, LayoutError, PlanError
from kvd.planner import CacheLayout, ModelGeometry, heads_per_rank, stage_layers
from kvd.planner.hybrid.layout import (
    HYBRID_KV_LAYOUTS,
    HybridRankLayout,
    hybrid_head_layout,
    vllm_rank_layout,
)
from kvd.planner.hybrid.mamba import MambaSpec, check_mamba_tp
from kvd.planner.hybrid.plan import (
    AttentionSpec,
    HybridModel,
    KVGroup,
    Layer,
    compat_hash,
    stage_ranges,
)
from kvd.planner.topology import Parallelism
from kvd.wire import protocol as P

POOL_ALIGN = 8  # pool sizes rounded up so every dtype's view of the pool is whole


def geometry(model: P.ModelSpec) -> ModelGeometry:
    """The planner's view of a model: KV heads, layers, MLA."""
    return ModelGeometry(num_kv_heads=model.num_kv_heads, num_layers=model.num_layers,
                         mla=model.mla)


def parallelism(tp_size: int, pp_size: int, partition: list[int] | None) -> Parallelism:
    """An engine's TP x PP (and uneven layer split) as the planner takes it."""
    return Parallelism(tp_size=tp_size, pp_size=pp_size,
                       layer_partition=tuple(partition) if partition else None)


def rank_layout(model: P.ModelSpec, layout: P.LayoutSpec, par: Parallelism, pp_rank: int,
                num_blocks: int | None = None) -> tuple[CacheLayout, int]:
    """(CacheLayout of one rank, global index of its first layer)."""
    geom = geometry(model)
    first, stop = stage_layers(geom, par, pp_rank)
    cache = CacheLayout(
        num_layers=stop - first,
        num_blocks=num_blocks if num_blocks is not None else layout.num_blocks,
        block_size_tokens=layout.block_size_tokens,
        num_heads=heads_per_rank(geom, par),
        head_dim=model.head_dim,
        dtype_nbytes=P.DTYPE_NBYTES[model.dtype],
        kv_layout=layout.kv_layout,
        head_layout=layout.head_layout,
        mla=model.mla,
    )
    cache.validate()
    return cache, first


def _nbytes(dtype: str, what: str) -> int:
    try:
        return P.DTYPE_NBYTES[dtype]
    except KeyError:
        raise KvdError(f"unsupported {what} {dtype!r}; known: {sorted(P.DTYPE_NBYTES)}") from None


@functools.lru_cache(maxsize=64)
def _model(raw: bytes) -> HybridModel:
    spec = msgspec.json.decode(raw, type=P.ModelSpec)
    h = spec.hybrid
    assert h is not None
    if len(h.layers) != spec.num_layers:
        raise PlanError(f"hybrid model lists {len(h.layers)} layers but num_layers is "
                        f"{spec.num_layers}")
    att = AttentionSpec(spec.num_kv_heads, spec.head_dim, _nbytes(spec.dtype, "dtype"), spec.mla)
    mamba = None
    if h.mamba is not None:
        m = h.mamba
        mamba = MambaSpec(m.num_heads, m.head_dim, m.n_groups, m.d_state, m.conv_kernel,
                          _nbytes(m.conv_dtype, "conv_dtype"), _nbytes(m.ssm_dtype, "ssm_dtype"))
    model = HybridModel(layers=tuple(Layer(x.kind, x.window_tokens) for x in h.layers),
                        groups=tuple(KVGroup(tuple(g)) for g in h.groups), attention=att,
                        mamba=mamba, name=spec.name)
    model.validate()
    return model


def hybrid_model(spec: P.ModelSpec) -> HybridModel:
    """The planner's model of a hybrid ModelSpec (cached; PlanError if inconsistent)."""
    return _model(msgspec.json.encode(spec))


def hybrid_compat(spec: P.ModelSpec, layout: P.LayoutSpec) -> str:
    """The hybrid part of an engine's compatibility key: every layer, group and shape."""
    assert spec.hybrid is not None
    return compat_hash(hybrid_model(spec), kv_layout=layout.kv_layout,
                       conv_layout=spec.hybrid.conv_layout)


@dataclass(frozen=True)
class HybridPool:
    """A hybrid rank's pool geometry; stands where a CacheLayout does for attention-only
    engines (registration sizes and shapes the pool from it, EngineDesc reports blocks)."""

    layout: HybridRankLayout
    num_blocks: int  # logical blocks (and Mamba slots) of the engine
    dtype_nbytes: int

    @property
    def total_nbytes(self) -> int:
        return max(POOL_ALIGN, -(-self.layout.end_nbytes // POOL_ALIGN) * POOL_ALIGN)

    @property
    def shape(self) -> tuple[int, ...]:
        """Flat: engines take per-group views with kvd.pool.hybrid_views."""
        return (self.total_nbytes // self.dtype_nbytes,)


def hybrid_rank_layout(spec: P.ModelSpec, layout: P.LayoutSpec, par: Parallelism,
                       pp_rank: int, num_blocks: int | None = None) -> HybridRankLayout:
    assert spec.hybrid is not None
    return vllm_rank_layout(hybrid_model(spec), par, pp_rank,
                            layout.num_blocks if num_blocks is None else num_blocks,
                            layout.block_size_tokens, spec.hybrid.conv_layout, layout.kv_layout)


def hybrid_rank_pool(spec: P.ModelSpec, layout: P.LayoutSpec, par: Parallelism,
                     pp_rank: int) -> tuple[HybridPool, int]:
    """(pool geometry, global index of the stage's first layer), or a clear refusal."""
    model = hybrid_model(spec)
    if layout.kv_layout not in HYBRID_KV_LAYOUTS:
        raise LayoutError(f"hybrid engines use vLLM's hybrid pool: kv_layout one of "
                          f"{HYBRID_KV_LAYOUTS} (layer outermost, whole blocks contiguous); "
                          f"got {layout.kv_layout!r}")
    if layout.head_layout != hybrid_head_layout(layout.kv_layout):
        raise LayoutError(f"kv_layout {layout.kv_layout} keeps heads "
                          f"{hybrid_head_layout(layout.kv_layout)} inside a page; got "
                          f"head_layout {layout.head_layout!r}")
    if layout.num_blocks < 1 or layout.block_size_tokens < 1:
        raise LayoutError("num_blocks and block_size_tokens must be >= 1")
    if model.mamba is not None and model.layers_of("mamba"):
        check_mamba_tp(model.mamba, par.tp_size, "engine")
    lay = hybrid_rank_layout(spec, layout, par, pp_rank)
    first = stage_ranges(model, par)[pp_rank][0]
    return HybridPool(lay, layout.num_blocks, _nbytes(spec.dtype, "dtype")), first



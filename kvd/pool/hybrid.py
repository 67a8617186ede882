"""A hybrid engine's geometry: its wire ModelSpec as the planner's model, and its pool.

What every engine is lives in ``kvd.daemon.engines``; this module holds the hybrid
specifics it needs and imports nothing back; the daemon's checks and pull assembly
for hybrid requests are in ``kvd.daemon.hybrid``. The connector computes the same
geometry from this module, so both sides size the pool alike. A hybrid rank's pool is
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
from kvd.planner.hybrid import (
    AttentionSpec,
    HybridModel,
    KVGroup,
    Layer,
    compat_hash,
    stage_ranges,
)
from kvd.planner.hybrid_layout import (
    HYBRID_KV_LAYOUTS,
    HybridRankLayout,
    hybrid_head_layout,
    vllm_rank_layout,
)
from kvd.planner.mamba import MambaSpec, check_mamba_tp
from kvd.planner.topology import Parallelism
from kvd.wire import protocol as P

POOL_ALIGN = 8  # pool sizes rounded up so every dtype's view of the pool is whole


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


def rank_layout(spec: P.ModelSpec, layout: P.LayoutSpec, par: Parallelism, pp_rank: int,
                num_blocks: int | None = None) -> HybridRankLayout:
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
    lay = rank_layout(spec, layout, par, pp_rank)
    first = stage_ranges(model, par)[pp_rank][0]
    return HybridPool(lay, layout.num_blocks, _nbytes(spec.dtype, "dtype")), first



"""Hybrid engines in the daemon: the wire description to the planner's, pools, pulls.

Everything hybrid the daemon needs lives here, so the registry, producer and
consumer only branch on ``ModelSpec.hybrid``: a hybrid rank's pool is vLLM's
hybrid layout (``vllm_rank_layout``: one tensor per layer position shared by
every group, attention pages in the engine's layout (vLLM's LBHNC or LBNHC, or
kvd's blocks_first), Mamba slots of the engine's own
pages-per-logical-block ratio), sized by its end; a request names one block-id
list per group (the flat fields carry their concatenation, so the existing
range and acquire checks see every id); a pull is planned by ``plan_hybrid``
and assembled by ``assemble_hybrid_pull``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvd import protocol as P
from kvd.errors import BlockIdError, KvdError, LayoutError, PlanError
from kvd.planner.assembly import ProducerReads
from kvd.planner.hybrid import (
    AttentionSpec,
    HybridModel,
    KVGroup,
    Layer,
    compat_hash,
    plan_hybrid,
    stage_ranges,
)
from kvd.planner.hybrid_assembly import HybridRankPool, assemble_hybrid_pull
from kvd.planner.hybrid_layout import (
    HYBRID_KV_LAYOUTS,
    HybridRankLayout,
    hybrid_head_layout,
    vllm_rank_layout,
)
from kvd.planner.mamba import MambaSpec, check_mamba_tp
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism

if TYPE_CHECKING:  # engines.py imports this module
    from kvd.daemon.engines import Engine
    from kvd.daemon.peers import RemoteEngine

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
        """Flat: engines take per-group views with kvd.hybrid_views."""
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


def check_group_ids(spec: P.ModelSpec, flat: Sequence[int],
                    groups: Sequence[Sequence[int]] | None, what: str) -> None:
    """Hybrid engines name one list per group, and the flat list is their concatenation;
    attention-only engines name no groups."""
    if spec.hybrid is None:
        if groups is not None:
            raise BlockIdError(f"{what}: per-group block ids for an engine without groups")
        return
    if groups is None:
        raise BlockIdError(f"{what}: a hybrid engine names one block-id list per KV-cache group")
    if len(groups) != len(spec.hybrid.groups):
        raise BlockIdError(f"{what}: {len(groups)} block-id lists for a model of "
                           f"{len(spec.hybrid.groups)} KV-cache groups")
    if [b for g in groups for b in g] != list(flat):
        raise BlockIdError(f"{what}: the flat block ids are not the groups' concatenation")


def expected_reads(spec: P.ModelSpec, producer: Parallelism, consumer: Parallelism,
                   ranks: Iterable[RankId]) -> int:
    """Notices a producer daemon hosting ``ranks`` waits for: one per (decode, prefill) pair."""
    plan = plan_hybrid(hybrid_model(spec), producer, consumer)
    return sum(plan.consumers.get(rank, 0) for rank in ranks)


def check_pull(spec: P.ModelSpec, msg: P.Pull) -> None:
    check_group_ids(spec, msg.local_block_ids, msg.local_group_block_ids, "pull (local)")
    check_group_ids(spec, msg.remote_block_ids, msg.remote_group_block_ids, "pull (remote)")


def assemble_pull(engine: Engine, remote: RemoteEngine, msg: P.Pull
                  ) -> dict[str, ProducerReads]:
    """A hybrid pull's READs, grouped by producer (the consumer posts one each)."""
    if msg.num_tokens < 0:
        raise LayoutError("a hybrid pull needs num_tokens (where each group's tail starts)")
    assert msg.local_group_block_ids is not None and msg.remote_group_block_ids is not None
    spec, rdesc = engine.model, remote.desc
    rpar = Parallelism(rdesc.tp_size, rdesc.pp_size,
                       tuple(rdesc.layer_partition) if rdesc.layer_partition else None)
    plan = plan_hybrid(hybrid_model(spec), rpar, engine.par)
    local = [HybridRankPool(r.rank, r.cache.layout, r.pool.addr, r.device_id)
             for r in engine.live_ranks() if isinstance(r.cache, HybridPool)]
    remote_pools = {
        rid: HybridRankPool(rid, rank_layout(spec, rdesc.layout, rpar, rid.pp_rank,
                                             rr.desc.num_blocks),
                            rr.desc.base_addr, rr.desc.device_id, owner=rr.agent)
        for rid, rr in remote.ranks.items()}
    return assemble_hybrid_pull(plan, local, remote_pools, msg.local_group_block_ids,
                                msg.remote_group_block_ids, msg.num_tokens,
                                owners=[d.agent for d in remote.daemons.values()])

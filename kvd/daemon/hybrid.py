"""Hybrid requests in the daemon: per-group block-id checks, the producer's READ count,
and the consumer's pull assembly.

A request names one block-id list per KV-cache group (the flat fields carry their
concatenation, so the existing range and acquire checks see every id); a pull is
planned by ``plan_hybrid`` and assembled by ``assemble_hybrid_pull``. The geometry
these need (model, pool layout) is ``kvd.pool.geometry``, which ``kvd.daemon.engines.table``
also uses; this module sits above both and nothing below imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvd.daemon.engines.table import Engine
from kvd.daemon.peers.remote import RemoteEngine
from kvd.errors import BlockIdError, LayoutError
from kvd.planner.assembly import ProducerReads
from kvd.planner.hybrid.assembly import HybridRankPool, assemble_hybrid_pull
from kvd.planner.hybrid.plan import plan_hybrid
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism
from kvd.pool.geometry import HybridPool, hybrid_model, hybrid_rank_layout
from kvd.wire import protocol as P


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


def assemble_pull(engine: Engine, remote: RemoteEngine, msg: P.Pull,
                  bases: Mapping[RankId, int] | None = None) -> dict[str, ProducerReads]:
    """A hybrid pull's READs, grouped by producer (the consumer posts one each).
    ``bases``: where the producer's pools are mapped here (the host path), by rank."""
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
        rid: HybridRankPool(rid, hybrid_rank_layout(spec, rdesc.layout, rpar, rid.pp_rank,
                                             rr.desc.num_blocks),
                            (bases or {}).get(rid, rr.desc.base_addr), rr.desc.device_id,
                            owner=rr.agent)
        for rid, rr in remote.ranks.items()}
    return assemble_hybrid_pull(plan, local, remote_pools, msg.local_group_block_ids,
                                msg.remote_group_block_ids, msg.num_tokens,
                                owners=[d.agent for d in remote.daemons.values()])

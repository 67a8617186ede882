"""Hybrid pull assembly: a hybrid plan, per-group block ids and both sides' pools to READs.

The hybrid counterpart of ``assemble_pull``, and as pure: no sockets, NIXL or
clocks, addresses are plain integers. One planner read is one (decode rank,
prefill rank) pair from ``HybridPlan.sources``: it moves every group at once
(attention, sliding-window and Mamba state), so the producer counts exactly
``HybridPlan.consumers`` notices however many groups the model has. Pairs are
grouped by the producer (NIXL agent) hosting the prefill rank: one READ each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvd.errors import LayoutError
from kvd.planner.assembly import ProducerReads
from kvd.planner.hybrid.layout import HybridRankLayout, build_hybrid_descriptors
from kvd.planner.hybrid.plan import HybridPlan
from kvd.planner.plan import RankId


@dataclass(frozen=True)
class HybridRankPool:
    """One rank's hybrid pool as the assembly sees it."""

    rank: RankId
    layout: HybridRankLayout
    base_addr: int
    device_id: int = 0
    owner: str = ""  # remote side: the producer (NIXL agent) hosting it


def assemble_hybrid_pull(plan: HybridPlan, local_ranks: Iterable[HybridRankPool],
                         remote_ranks: Mapping[RankId, HybridRankPool],
                         local_group_ids: Sequence[Sequence[int]],
                         remote_group_ids: Sequence[Sequence[int]], num_tokens: int,
                         owners: Iterable[str] = ()) -> dict[str, ProducerReads]:
    """Descriptors of one hybrid pull, grouped by producer.

    No local block in any group is a notify-only pull: every pair still counts, so
    the producer releases the request. ``owners`` lists producers to report even
    when no pair reads from them.
    """
    groups: dict[str, ProducerReads] = {o: ProducerReads(o) for o in owners}
    notify_only = not any(len(ids) for ids in local_group_ids)
    for lr in local_ranks:
        for src in plan.sources(lr.rank):
            rr = remote_ranks.get(src)
            if rr is None:
                raise LayoutError(f"plan reads remote rank {src.key}, which is not known")
            g = groups.setdefault(rr.owner, ProducerReads(rr.owner))
            g.reads += 1
            if notify_only:
                continue
            d = build_hybrid_descriptors(plan, lr.rank, src, lr.layout, rr.layout,
                                         local_group_ids, remote_group_ids, num_tokens).merged()
            g.add(d.local_offsets.astype("int64") + lr.base_addr,
                  d.remote_offsets.astype("int64") + rr.base_addr, d.nbytes.astype("int64"),
                  lr.device_id, rr.device_id)
    return groups

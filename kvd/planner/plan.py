"""The transfer plan: for every decode rank, which prefill rank serves which cells.

A cell is one (KV head, layer) pair. A decode rank must receive each cell it
holds exactly once; the plan decides from whom. Where several prefill ranks
hold the same cells (GQA replication, MLA) the choice is free, and we spend it
on balance: a prefill rank that serves every decode rank becomes the NIC
bottleneck, which is what vLLM's "always the first replica" rule does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvd.planner.topology import (
    ModelGeometry,
    Parallelism,
    check_parallelism,
    head_holders,
    partition,
    rank_heads,
)


@dataclass(frozen=True, order=True)
class RankId:
    """One engine rank; ordering is (tp_rank, pp_rank)."""

    tp_rank: int
    pp_rank: int = 0

    @property
    def key(self) -> str:
        """The "tp/pp" spelling used in JSON and on the wire."""
        return f"{self.tp_rank}/{self.pp_rank}"


@dataclass(frozen=True)
class Read:
    """One remote read: a contiguous head range over a contiguous layer range.

    The three head ranges name the same heads in three coordinate systems, so
    the byte layer never re-derives ownership.
    """

    remote: RankId  # prefill rank to read from
    heads: tuple[int, int]  # global head range
    local_heads: tuple[int, int]  # inside the decode rank's head dimension
    remote_heads: tuple[int, int]  # inside the prefill rank's head dimension
    layers: tuple[int, int]  # global layer range

    @property
    def num_cells(self) -> int:
        """(head, layer) cells moved: the read's size in units of one head-layer."""
        return (self.heads[1] - self.heads[0]) * (self.layers[1] - self.layers[0])

    def to_json(self) -> dict:
        return {
            "remote_tp_rank": self.remote.tp_rank,
            "remote_pp_rank": self.remote.pp_rank,
            "heads": list(self.heads),
            "local_heads": list(self.local_heads),
            "remote_heads": list(self.remote_heads),
            "layers": list(self.layers),
        }


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The whole pairing of one prefill engine with one decode engine.

    Shared through the cache, so its mappings are read-only views.
    """

    model: ModelGeometry
    prefill: Parallelism
    decode: Parallelism
    reads: Mapping[RankId, tuple[Read, ...]]  # every decode rank, pp-major order
    consumers: Mapping[RankId, int]  # every prefill rank -> Reads that target it

    def reads_for(self, decode_rank: RankId) -> tuple[Read, ...]:
        """Reads of one decode rank; a rank outside the engine is a caller bug."""
        return self.reads[decode_rank]

    @property
    def num_reads(self) -> int:
        return sum(len(r) for r in self.reads.values())

    def to_json(self) -> dict:
        """The `kvd plan --json` shape (docs/planner.md), plus the inputs for context."""
        return {
            "model": {
                "kv_heads": self.model.num_kv_heads,
                "layers": self.model.num_layers,
                "mla": self.model.mla,
            },
            "prefill": _par_json(self.model, self.prefill),
            "decode": _par_json(self.model, self.decode),
            "decode_ranks": [
                {
                    "tp_rank": rank.tp_rank,
                    "pp_rank": rank.pp_rank,
                    "reads": [read.to_json() for read in reads],
                }
                for rank, reads in self.reads.items()
            ],
            "consumers": {rank.key: n for rank, n in self.consumers.items()},
        }


def _par_json(model: ModelGeometry, par: Parallelism) -> dict:
    return {"tp": par.tp_size, "pp": par.pp_size, "layer_partition": list(partition(model, par))}


def _stage_ranges(model: ModelGeometry, par: Parallelism) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for n in partition(model, par):
        ranges.append((start, start + n))
        start += n
    return ranges


@functools.lru_cache(maxsize=1024)
def plan_transfer(model: ModelGeometry, prefill: Parallelism, decode: Parallelism) -> TransferPlan:
    """Plan one engine pair; cached because the daemon asks for every request.

    Decode ranks are visited pp-major, and each replicated choice goes to the
    holder with the fewest cells assigned so far (then fewest reads, then
    lowest rank), which keeps replicas within one read of each other whenever
    the reads have equal size.
    """
    check_parallelism(model, prefill, "prefill")
    check_parallelism(model, decode, "decode")
    p_stages = _stage_ranges(model, prefill)
    p_ids = [[RankId(tp, pp) for tp in range(prefill.tp_size)] for pp in range(prefill.pp_size)]
    cells = {rank: 0 for stage in p_ids for rank in stage}
    counts = dict(cells)

    reads: dict[RankId, tuple[Read, ...]] = {}
    for d_pp, (dl0, dl1) in enumerate(_stage_ranges(model, decode)):
        overlaps = [
            (p_pp, max(dl0, pl0), min(dl1, pl1))
            for p_pp, (pl0, pl1) in enumerate(p_stages)
            if pl0 < dl1 and dl0 < pl1
        ]
        for d_tp in range(decode.tp_size):
            h0, h1 = rank_heads(model, decode, d_tp)
            out: list[Read] = []
            for p_pp, l0, l1 in overlaps:
                head = h0
                while head < h1:
                    holders = head_holders(model, prefill, head)
                    stage_ids = p_ids[p_pp]
                    if len(holders) == 1:
                        remote = stage_ids[holders[0]]
                    else:
                        remote = min(
                            (stage_ids[tp] for tp in holders),
                            key=lambda r: (cells[r], counts[r], r.tp_rank),
                        )
                    ph0, ph1 = rank_heads(model, prefill, remote.tp_rank)
                    end = min(h1, ph1)
                    read = Read(
                        remote=remote,
                        heads=(head, end),
                        local_heads=(head - h0, end - h0),
                        remote_heads=(head - ph0, end - ph0),
                        layers=(l0, l1),
                    )
                    cells[remote] += read.num_cells
                    counts[remote] += 1
                    out.append(read)
                    head = end
            reads[RankId(d_tp, d_pp)] = tuple(out)

    return TransferPlan(
        model=model,
        prefill=prefill,
        decode=decode,
        reads=MappingProxyType(reads),
        consumers=MappingProxyType(counts),
    )

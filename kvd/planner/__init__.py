"""The planner: pure functions from engine geometry to reads and byte ranges.

No sockets, NIXL, clocks or torch here, so `kvd plan` starts fast and every
rule can be property-tested byte by byte.
"""

from kvd.planner.descriptors import Descriptors, build_read_descriptors
from kvd.planner.layout import CacheLayout
from kvd.planner.plan import RankId, Read, TransferPlan, plan_transfer
from kvd.planner.topology import (
    ModelGeometry,
    Parallelism,
    check_parallelism,
    default_partition,
    head_holders,
    heads_per_rank,
    rank_heads,
    stage_layers,
)

__all__ = [
    "CacheLayout",
    "Descriptors",
    "ModelGeometry",
    "Parallelism",
    "RankId",
    "Read",
    "TransferPlan",
    "build_read_descriptors",
    "check_parallelism",
    "default_partition",
    "head_holders",
    "heads_per_rank",
    "plan_transfer",
    "rank_heads",
    "stage_layers",
]

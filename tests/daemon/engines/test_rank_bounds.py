"""A registration or a peer claiming a huge TP/PP size must be refused, never enumerated.

Regression: a fuzzed RegisterEngine with a tiny KV-head count and tp_size in the
billions was accepted (replication allows t % K == 0), and the next pull on that
engine built the list of every rank id on the event loop: the daemon froze.
"""

from __future__ import annotations

import time

import pytest

from kvd.daemon.engines.table import MISSING_RANKS_SHOWN, Engine
from kvd.errors import PlanError
from kvd.planner import ModelGeometry, Parallelism, RankId, check_parallelism
from kvd.planner.topology import MAX_PARALLEL_SIZE
from kvd.wire.protocol import LayoutSpec, ModelSpec


@pytest.mark.parametrize("par", [Parallelism(tp_size=2**40), Parallelism(1, pp_size=2**33),
                                 Parallelism(tp_size=MAX_PARALLEL_SIZE + 1)])
def test_oversized_parallelism_is_refused_naming_the_bound(par: Parallelism) -> None:
    with pytest.raises(PlanError, match=f"exceeds {MAX_PARALLEL_SIZE}"):
        check_parallelism(ModelGeometry(num_kv_heads=1, num_layers=2**40), par, "engine")


def test_largest_allowed_engine_plans() -> None:
    check_parallelism(ModelGeometry(num_kv_heads=1, num_layers=MAX_PARALLEL_SIZE),
                      Parallelism(MAX_PARALLEL_SIZE, MAX_PARALLEL_SIZE), "engine")


def test_missing_ranks_never_enumerates_the_whole_engine() -> None:
    engine = Engine(engine_id="e", model=ModelSpec(name="m", num_kv_heads=1, num_layers=1,
                                                   head_dim=8),
                    layout=LayoutSpec(num_blocks=1, block_size_tokens=1),
                    par=Parallelism(tp_size=2**40, pp_size=2**20), engine_daemons=[])
    engine.ranks[RankId(0, 0)] = object()  # type: ignore[assignment]
    t0 = time.perf_counter()
    missing = engine.missing_ranks("tcp://me:1")
    assert time.perf_counter() - t0 < 0.1
    assert missing == [RankId(t, 0) for t in range(1, MISSING_RANKS_SHOWN + 1)]

"""Bench geometry (a Llama-3-8B-like cache), scenarios, targets and small stats helpers.

Also the descriptors kvd builds for one pull of a scenario, so that raw NIXL can be
timed moving exactly the same ones (``kvd_descriptors``): they come from
``kvd.planner.assembly.assemble_pull``, the function the consumer daemon calls, so the
bench measures the product's own descriptors by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

MiB = 1 << 20
# The first targets: homogeneous >= 0.85x memcpy and hetero >= 0.7x (on huge-page
# pools), kvd >= 0.95x the best raw NIXL READ on the same memory, 1-block p50 <= 0.5 ms
# and p99 <= 2 ms.
TARGET_RATIO_KVD_MEMCPY = 0.85
TARGET_RATIO_HETERO_MEMCPY = 0.7
TARGET_RATIO_KVD_NIXL = 0.95
TARGET_P50_MS = 0.5
TARGET_P99_MS = 2.0
# The posting-workers targets: each scenario >= 1.3x the best single-stream raw NIXL
# READ of the same bytes on the same memory kind (several posting workers), 16
# concurrent 32 MiB pulls >= 0.9x one such pull, 1-block pull p50 <= 1.5x and p99 <= 3x
# the floor of the run.
TARGET_RATIO_SINGLE_STREAM = 1.3
TARGET_RATIO_CONCURRENT = 0.9
TARGET_FLOOR_P50 = 1.5
TARGET_FLOOR_P99 = 3.0
DEFAULT_SHM_DIR = "/dev/shm"


# The bench's default layout: the fewest descriptors for homogeneous pulls (one per
# block) and for hetero TP (one per block per decode rank); docs/planner.md compares them.
DEFAULT_KV_LAYOUT = "head_major"


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size_tokens: int = 16
    kv_layout: str = DEFAULT_KV_LAYOUT
    head_layout: str = "HND"

    def model(self) -> ModelSpec:
        return ModelSpec(name="bench-model", num_kv_heads=self.kv_heads, num_layers=self.layers,
                         head_dim=self.head_dim, dtype=self.dtype, mla=False)

    @property
    def token_nbytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    @property
    def block_nbytes(self) -> int:
        return self.token_nbytes * self.block_size_tokens

    def shape(self, tp: int, num_blocks: int) -> EngineShape:
        return EngineShape(tp, 1, self.block_size_tokens, num_blocks=num_blocks,
                           kv_layout=self.kv_layout, head_layout=self.head_layout)

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "block_size_tokens": self.block_size_tokens,
                "kv_layout": self.kv_layout, "head_layout": self.head_layout,
                "token_nbytes": self.token_nbytes, "block_nbytes": self.block_nbytes}


@dataclass(frozen=True)
class Scenario:
    name: str
    prefill_tp: int
    decode_tp: int


HOMOGENEOUS = Scenario("homogeneous", 1, 1)
HETERO = Scenario("hetero", 1, 2)
# Four prefill ranks into two decode ranks: each decode rank reads from two daemons'
# worth of ranks (here one daemon hosts all four), the other direction of hetero TP.
HETERO_4TO2 = Scenario("hetero_4to2", 4, 2)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(np.ceil(q / 100 * len(s))) - 1))
    return s[k]


# Former private names, still imported by other bench modules.
fmt_gbps, fmt_ms, fmt_pct = gbps, ms, pct


def kvd_descriptors(geom: Geometry, scn: Scenario, p_blocks: int, d_blocks: int,
                    p_ids: list[int], d_ids: list[int]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The descriptors kvd builds for one pull, as offsets into the concatenated pools.

    Returns (local offsets, remote offsets, sizes, local bytes, remote bytes): local
    offsets index the decode ranks' pools laid end to end, remote ones the prefill's.
    """
    from kvd.planner import RankId, plan_transfer
    from kvd.planner.assembly import RankPool, assemble_pull, match_tail
    from kvd.pool.geometry import geometry, parallelism, rank_layout

    model = geom.model()
    lspec = layout_spec(geom.shape(scn.decode_tp, d_blocks))
    rspec = layout_spec(geom.shape(scn.prefill_tp, p_blocks))
    lpar, rpar = parallelism(scn.decode_tp, 1, None), parallelism(scn.prefill_tp, 1, None)
    plan = plan_transfer(geometry(model), rpar, lpar)
    lcache, lfirst = rank_layout(model, lspec, lpar, 0)
    rcache, rfirst = rank_layout(model, rspec, rpar, 0)
    local_ids, remote_ids = match_tail(d_ids, p_ids, geom.block_size_tokens,
                                       geom.block_size_tokens)
    # Pools laid end to end from address 0 on each side: addresses are offsets.
    local = [RankPool(RankId(t, 0), lcache, lfirst, t * lcache.total_nbytes)
             for t in range(scn.decode_tp)]
    remote = {RankId(t, 0): RankPool(RankId(t, 0), rcache, rfirst, t * rcache.total_nbytes)
              for t in range(scn.prefill_tp)}
    [reads] = assemble_pull(plan, local, remote, local_ids, remote_ids).values()
    return (reads.local_addrs, reads.remote_addrs, reads.nbytes,
            scn.decode_tp * lcache.total_nbytes, scn.prefill_tp * rcache.total_nbytes)

"""Engines whose blocks hold different numbers of tokens (``Knobs.engine_block_tokens``):
real cache layouts for the simulated pools, kvd's own planner for a pull between two of
them, and the ground truth of where each token's bytes lie.

What is real: the assembly of a pull (kvd.planner.assembly's `match_tail` and
`prepare_pull`, the plan of kvd.planner.plan, the descriptors of kvd.planner.
descriptors) over each engine's `CacheLayout` (kvd.pool.geometry.rank_layout): a READ is
the byte ranges the planner names, copied as they are (support.fleet.transport).

What is not kvd's: `token_cells`, where a token's cells lie in a block, written here
from the layouts' definitions (the axis orders of kvd.planner.layout's docstrings and of
vLLM's names), so the checks (`same_tokens`) do not take the planner's word for it.

Every engine of a run shares one layout (drawn per seed, `draw`): engines that pair must
be compatible (model, kv_layout, head_layout; not block size or count). Only layouts
whose block is outermost: a block is one row of the simulated pool, as the engines'
block ownership (and the scribbles of a freed block) assume.
"""

from __future__ import annotations

import functools
import math
import random
from typing import TYPE_CHECKING

import numpy as np

from kvd.planner import RankId
from kvd.planner.assembly import ProducerReads, RankPool, match_tail, prepare_pull
from kvd.planner.layout import CacheLayout
from kvd.planner.plan import TransferPlan, plan_transfer
from kvd.pool.geometry import geometry, parallelism, rank_layout
from kvd.wire import protocol as P

if TYPE_CHECKING:
    from support.fleet.fakes import FakeEngine

MODEL = P.ModelSpec(name="sim-layouts", num_kv_heads=2, num_layers=2, head_dim=2,
                    dtype="float8_e4m3fn")
# cells of one token: layers (L), K and V (K), heads (H), a head's bytes (D)
SIZES = {"L": 2, "K": 2, "H": 2, "D": 2}
TOKEN_BYTES = math.prod(SIZES.values())
# (kv_layout, head_layout) -> the axes inside one block, outermost first (N: the token).
# cross_layer: [block][layer][kv][body], body HND [head][token][dim] or NHD
# [token][head][dim]; head_major: [block][head][layer][kv][token][dim]; vLLM's names
# spell their axes (B block, L, H, N, C = K then V, each head_dim).
LAYOUTS = {
    ("cross_layer", "HND"): "LKHND",
    ("cross_layer", "NHD"): "LKNHD",
    ("head_major", "HND"): "HLKND",
    ("BLHNC", "HND"): "LHNKD",
    ("BLNHC", "NHD"): "LNHKD",
    ("BHLNC", "HND"): "HLNKD",
}
RANK = RankId(0, 0)
PAR = parallelism(1, 1, None)


def draw(seed: int) -> tuple[str, str]:
    """The run's layout (its own stream: no other draw of the run moves)."""
    return random.Random(f"layout-{seed}").choice(sorted(LAYOUTS))


def block_bytes(block_tokens: int) -> int:
    return TOKEN_BYTES * block_tokens


@functools.cache
def token_cells(layout: tuple[str, str], block_tokens: int) -> np.ndarray:
    """(block_tokens, TOKEN_BYTES): the byte offsets in a block of each token's cells, in
    (layer, kv, head, byte) order: the same cell in the same column on any layout."""
    sizes = dict(SIZES, N=block_tokens)
    strides, stride = {}, 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = stride
        stride *= sizes[axis]
    lay, kv, head, byte = np.meshgrid(*(np.arange(SIZES[a]) for a in "LKHD"), indexing="ij")
    cell = (lay * strides["L"] + kv * strides["K"] + head * strides["H"]
            + byte * strides["D"]).reshape(-1)
    return np.arange(block_tokens)[:, None] * strides["N"] + cell[None, :]


def cache(layout: tuple[str, str], num_blocks: int, block_tokens: int) -> CacheLayout:
    """kvd's own CacheLayout of such an engine's pool (one rank)."""
    spec = P.LayoutSpec(num_blocks=num_blocks, block_size_tokens=block_tokens,
                        kv_layout=layout[0], head_layout=layout[1])
    lay, _ = rank_layout(MODEL, spec, PAR, 0)
    assert lay.total_nbytes == num_blocks * block_bytes(block_tokens)
    return lay


@functools.cache
def _plan() -> TransferPlan:
    return plan_transfer(geometry(MODEL), PAR, PAR)


def assemble(engine: FakeEngine, src: FakeEngine, msg: P.Pull, owner: str, span: int
             ) -> dict[str, ProducerReads]:
    """As kvd.daemon.pull.assemble.PullAssembler: the remote blocks that fill the local
    ones (`match_tail`), then the planner's reads between the two pools (addresses: a
    pool's registration uid times ``span`` plus the byte offset)."""
    local_ids, remote_ids = match_tail(msg.local_block_ids, msg.remote_block_ids,
                                       engine.layout.block_size_tokens,
                                       src.layout.block_size_tokens, msg.num_tokens)
    prepared = prepare_pull(_plan(), [RankPool(RANK, engine.cache, 0, engine.uid * span)],
                            {RANK: RankPool(RANK, src.cache, 0, src.uid * span, owner=owner)},
                            (owner,))
    return prepared.assemble(local_ids, remote_ids)


def write_token(pool: np.ndarray, layout: tuple[str, str], block_tokens: int, block: int,
                token: int, data: np.ndarray) -> None:
    """A prefill computes ``token`` (its offset in ``block``): its cells get ``data``."""
    pool[block, token_cells(layout, block_tokens)[token]] = data


def same_tokens(layout: tuple[str, str], dst: np.ndarray, dst_blocks: list[int],
                dst_block_tokens: int, src: np.ndarray, src_block_tokens: int,
                first: int, tokens: int) -> bool:
    """Tokens [first, tokens) in ``dst`` (the decode's pool, its blocks from token
    ``first`` on) hold the cells they hold in ``src`` (the prefill's blocks in order,
    from token 0)."""
    t = np.arange(first, tokens)
    bl, br = dst_block_tokens, src_block_tokens
    dcells = token_cells(layout, bl)[t % bl]
    scells = token_cells(layout, br)[t % br]
    dblocks = np.asarray(dst_blocks)[(t - first) // bl]
    got = dst[dblocks[:, None], dcells]
    want = src[(t // br)[:, None], scells]
    return bool(np.array_equal(got, want))

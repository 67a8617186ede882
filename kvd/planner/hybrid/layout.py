"""From a hybrid plan to byte ranges: every KV-cache group of one request, rank to rank.

Each group has its own block geometry on each side. Attention groups page
tokens in kernel blocks, and a request's block id names a *logical* block of
`blocks_per_logical` kernel blocks. In vLLM's hybrid pools that ratio is the
Mamba state of one rank over one attention kernel page, rounded up, so it
differs between TP sizes (the seed's Nemotron 30B: 131 at TP 4, 261 at TP 1)
and each side's ids are expanded with that side's own ratio. The two sides
are then paired token by token: both block lists name the *last* blocks of
the request (a decode prefix hit names fewer), and the tokens read are
[start, num_tokens) with start the decode's first uncached token, or for a
sliding-window group the first token the next one still attends to,
whichever is later. Mamba groups pair state slots one to one (vLLM: one slot
per request and group); their bytes do not depend on block size at all, so
block-size ratios between the sides cost nothing there.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError
from kvd.planner.descriptors import Descriptors, build_read_descriptors
from kvd.planner.hybrid.mamba import mamba_rank_shape
from kvd.planner.hybrid.mamba_layout import MambaStateLayout, build_mamba_descriptors, merge_ranges
from kvd.planner.hybrid.plan import TOKEN_KINDS, HybridModel, HybridPlan, stage_ranges
from kvd.planner.layout import CacheLayout, vllm_head_layout
from kvd.planner.plan import RankId, Read
from kvd.planner.topology import Parallelism, heads_per_rank


@dataclass(frozen=True)
class AttentionGroupLayout:
    """One attention group's layers on one rank: a CacheLayout of kernel blocks at an offset."""

    cache: CacheLayout  # num_layers = the group's layers on this stage; blocks are kernel blocks
    blocks_per_logical: int = 1  # kernel blocks per block id of the request
    base_offset_nbytes: int = 0

    @property
    def logical_block_tokens(self) -> int:
        return self.cache.block_size_tokens * self.blocks_per_logical

    @property
    def end_nbytes(self) -> int:
        return self.base_offset_nbytes + self.cache.total_nbytes


GroupLayout = AttentionGroupLayout | MambaStateLayout | None

# Attention page orders a hybrid pool can have: each layer position's tensor holds whole
# blocks one after another (the Mamba layers sharing it see slots of ``ratio`` pages), so
# the layer axis is outermost and a block's page is contiguous. vLLM's attention backends
# give LBHNC (its default; the only one vLLM's CPU attention takes) or LBNHC; kvd's own
# engines may keep blocks_first ([block][K|V][head][token][dim]).
HYBRID_KV_LAYOUTS = ("LBHNC", "LBNHC", "blocks_first")


def hybrid_head_layout(kv_layout: str) -> str:
    """The head order inside a page of ``kv_layout`` (LayoutSpec.head_layout must agree)."""
    if kv_layout not in HYBRID_KV_LAYOUTS:
        raise LayoutError(f"a hybrid pool's attention pages are one of {HYBRID_KV_LAYOUTS} "
                          f"(layer outermost, whole blocks contiguous), got {kv_layout!r}")
    return "HND" if kv_layout == "blocks_first" else vllm_head_layout(kv_layout)


@dataclass(frozen=True)
class HybridRankLayout:
    """Where one rank keeps every group: one entry per model group, in the model's order.

    None for a group none of whose layers are on this rank's PP stage. Offsets
    are inside the rank's one pool region; groups may share bytes (vLLM's pools
    do) as long as their block ids never do.
    """

    groups: tuple[GroupLayout, ...]

    @property
    def end_nbytes(self) -> int:
        return max((g.end_nbytes for g in self.groups if g is not None), default=0)


def physical_blocks_per_logical(mamba_state_nbytes: int, attn_page_nbytes: int) -> int:
    """Kernel attention pages one logical block spans so that a Mamba state fits in it.

    vLLM raises the attention block size until one block's pages hold a whole
    Mamba state of this rank; per rank both sides scale with TP differently
    (SSM heads always shard, KV heads replicate past K), hence a per-engine ratio.
    """
    if attn_page_nbytes < 1:
        raise LayoutError(f"attention page must be >= 1 B, got {attn_page_nbytes}")
    return max(1, -(-mamba_state_nbytes // attn_page_nbytes))


def _positions(layers: tuple[int, ...], span: tuple[int, int]) -> tuple[int, int]:
    """The group's layer numbers (its i-th layer) whose global index is in span."""
    return bisect.bisect_left(layers, span[0]), bisect.bisect_left(layers, span[1])


def vllm_rank_layout(model: HybridModel, par: Parallelism, pp_rank: int,
                     num_logical_blocks: int, kernel_block_tokens: int,
                     conv_layout: str = "DS", kv_layout: str = "blocks_first"
                     ) -> HybridRankLayout:
    """One rank's pool as vLLM's hybrid allocator lays it out.

    One tensor per layer position j, shared by the j-th layer (on this stage) of
    every group: num_logical_blocks * ratio attention kernel pages in
    ``kv_layout`` (vLLM's LBHNC: [block][head][token][K||V]; kvd's blocks_first:
    [block][K|V][head][token][dim]); a Mamba layer views the same tensor as slots
    of `ratio` pages with [conv | ssm] at the start of each. The tensors follow
    one another in the pool.
    """
    head_layout = hybrid_head_layout(kv_layout)
    geom = model.geometry
    first, stop = stage_ranges(model, par)[pp_rank]
    att = model.attention
    heads = heads_per_rank(geom, par)
    page = 0
    if att is not None and model.layers_of(*TOKEN_KINDS):
        page = (1 if att.mla else 2) * kernel_block_tokens * heads * att.head_dim * att.dtype_nbytes
    state = 0
    if model.mamba is not None and model.layers_of("mamba"):
        state = mamba_rank_shape(model.mamba, par.tp_size).state_nbytes
    if page == 0:  # no attention: a slot is exactly one state
        page = state
    ratio = physical_blocks_per_logical(state, page) if state else 1
    tensor_nbytes = num_logical_blocks * ratio * page
    out: list[GroupLayout] = []
    for g, group in enumerate(model.groups):
        a, b = _positions(group.layers, (first, stop))
        if a == b:
            out.append(None)
        elif model.group_kind(g) in TOKEN_KINDS and att is not None:
            cache = CacheLayout(num_layers=b - a, num_blocks=num_logical_blocks * ratio,
                                block_size_tokens=kernel_block_tokens, num_heads=heads,
                                head_dim=att.head_dim, dtype_nbytes=att.dtype_nbytes,
                                kv_layout=kv_layout, head_layout=head_layout,
                                mla=att.mla)
            out.append(AttentionGroupLayout(cache=cache, blocks_per_logical=ratio))
        elif model.mamba is not None:
            out.append(MambaStateLayout(
                spec=model.mamba, tp_size=par.tp_size, num_layers=b - a,
                num_blocks=num_logical_blocks, conv_layout=conv_layout,
                slot_stride_nbytes=ratio * page, layer_stride_nbytes=tensor_nbytes))
    return HybridRankLayout(tuple(out))


# ---------------------------------------------------------------- descriptors


@dataclass(frozen=True)
class HybridDescriptors:
    """One (decode rank, prefill rank) transfer of one request: descriptors per group."""

    groups: tuple[Descriptors, ...]

    def __len__(self) -> int:
        return sum(len(d) for d in self.groups)

    @property
    def total_nbytes(self) -> int:
        return sum(d.total_nbytes for d in self.groups)

    def merged(self) -> Descriptors:
        """All groups in one list, joined again where groups happen to be adjacent."""
        return merge_ranges(np.concatenate([d.local_offsets for d in self.groups] or [[]]),
                            np.concatenate([d.remote_offsets for d in self.groups] or [[]]),
                            np.concatenate([d.nbytes for d in self.groups] or [[]]))


def _kernel_ids(ids: np.ndarray, first_logical: int, blocks_per_logical: int,
                kernel_tokens: int, start: int, stop: int) -> np.ndarray:
    """Kernel block ids holding tokens [start, stop) (start kernel-aligned)."""
    k = np.arange(start // kernel_tokens, -(-stop // kernel_tokens), dtype=np.int64)
    return ids[k // blocks_per_logical - first_logical] * blocks_per_logical \
        + k % blocks_per_logical


def token_span(local: AttentionGroupLayout, remote: AttentionGroupLayout, num_local_blocks: int,
               num_remote_blocks: int, num_tokens: int, window_tokens: int = 0
               ) -> tuple[int, int, int, int]:
    """(first token read, first local logical block, first remote logical block, num_tokens).

    Both lists name the last blocks of a num_tokens request. A sliding window of
    w keeps tokens >= num_tokens - w + 1 (vLLM's SlidingWindowManager skips the
    rest); the start is rounded down to the larger kernel block so whole kernel
    blocks move on both sides.
    """
    lt, rt = local.logical_block_tokens, remote.logical_block_tokens
    first_l = -(-num_tokens // lt) - num_local_blocks
    first_r = -(-num_tokens // rt) - num_remote_blocks
    if first_l < 0:
        raise LayoutError(f"pull names {num_local_blocks} local blocks of {lt} tokens but the "
                          f"request has only {num_tokens} tokens")
    if first_r < 0:
        raise LayoutError(f"pull names {num_remote_blocks} remote blocks of {rt} tokens but the "
                          f"request has only {num_tokens} tokens")
    start = first_l * lt
    if window_tokens:
        start = max(start, num_tokens - window_tokens + 1)
    if start >= num_tokens:  # nothing left to read (a window of 1 keeps no past token)
        return num_tokens, first_l, first_r, num_tokens
    align = max(local.cache.block_size_tokens, remote.cache.block_size_tokens)
    start = start // align * align
    if start < first_l * lt:
        raise LayoutError(f"the decode side's first block starts at token {first_l * lt}, inside "
                          f"a prefill kernel block of {align} tokens: a prefix hit must cover "
                          "whole prefill kernel blocks")
    if start < first_r * rt:
        raise LayoutError(f"prefill names blocks from token {first_r * rt} but the pull needs "
                          f"token {start}")
    return start, first_l, first_r, num_tokens


def _attention_group(plan: HybridPlan, g: int, reads: list[Read], local: GroupLayout,
                     local_first: int, remote: GroupLayout, remote_first: int,
                     local_ids: np.ndarray, remote_ids: np.ndarray, num_tokens: int
                     ) -> Descriptors:
    layers = plan.model.groups[g].layers
    spans = [(r, _positions(layers, r.layers)) for r in reads]
    spans = [(r, span) for r, span in spans if span[0] < span[1]]
    if not spans or local_ids.size == 0:
        return merge_ranges(np.zeros(0), np.zeros(0), np.zeros(0))
    if not isinstance(local, AttentionGroupLayout) or not isinstance(remote, AttentionGroupLayout):
        raise LayoutError(f"group {g} is attention but a rank's layout for it is {local!r} / "
                          f"{remote!r}")
    start, first_l, first_r, stop = token_span(local, remote, local_ids.size, remote_ids.size,
                                               num_tokens, plan.model.group_window(g))
    if start >= stop:
        return merge_ranges(np.zeros(0), np.zeros(0), np.zeros(0))
    lk = _kernel_ids(local_ids, first_l, local.blocks_per_logical, local.cache.block_size_tokens,
                     start, stop)
    rk = _kernel_ids(remote_ids, first_r, remote.blocks_per_logical,
                     remote.cache.block_size_tokens, start, stop)
    parts = []
    for read, span in spans:
        group_read = Read(read.remote, read.heads, read.local_heads, read.remote_heads, span)
        d = build_read_descriptors(group_read, local.cache, local_first, remote.cache,
                                   remote_first, lk, rk)
        parts.append((d.local_offsets + local.base_offset_nbytes,
                      d.remote_offsets + remote.base_offset_nbytes, d.nbytes))
    return merge_ranges(*(np.concatenate(x) for x in zip(*parts, strict=True)))


def build_hybrid_descriptors(plan: HybridPlan, decode_rank: RankId, prefill_rank: RankId,
                             local: HybridRankLayout, remote: HybridRankLayout,
                             local_block_ids: Sequence[Sequence[int]],
                             remote_block_ids: Sequence[Sequence[int]],
                             num_tokens: int) -> HybridDescriptors:
    """Everything decode_rank reads from prefill_rank for one request, per group.

    local_block_ids / remote_block_ids: one list per model group (vLLM's
    block_ids). Attention groups: logical block ids, the last blocks of the
    request (a decode prefix hit names fewer; no local ids: nothing to read).
    Mamba groups: state slots, paired one to one. num_tokens: tokens the
    prefill computed for the request.
    """
    model = plan.model
    n_groups = len(model.groups)
    for name, lay, ids in (("local", local, local_block_ids), ("remote", remote, remote_block_ids)):
        if len(lay.groups) != n_groups or len(ids) != n_groups:
            raise LayoutError(f"{name} side gives {len(lay.groups)} group layouts and {len(ids)} "
                              f"block-id lists for a model of {n_groups} groups")
    if num_tokens < 0:
        raise LayoutError(f"num_tokens must be >= 0, got {num_tokens}")
    d_stage = stage_ranges(model, plan.decode)[decode_rank.pp_rank]
    p_stage = stage_ranges(model, plan.prefill)[prefill_rank.pp_rank]
    att_reads = [r for r in plan.attention[decode_rank] if r.remote == prefill_rank]
    mamba_reads = [r for r in plan.mamba[decode_rank] if r.remote == prefill_rank]
    out = []
    for g, group in enumerate(model.groups):
        lay_l, lay_r = local.groups[g], remote.groups[g]
        la, lb = _positions(group.layers, d_stage)
        ra, rb = _positions(group.layers, p_stage)
        for name, lay, count in (("local", lay_l, lb - la), ("remote", lay_r, rb - ra)):
            held = 0 if lay is None else (lay.cache.num_layers if isinstance(
                lay, AttentionGroupLayout) else lay.num_layers)
            if held != count:
                raise LayoutError(f"group {g}: the {name} rank's stage holds {count} of its "
                                  f"layers but its layout has {held}")
        lids = np.asarray(local_block_ids[g], dtype=np.int64).reshape(-1)
        rids = np.asarray(remote_block_ids[g], dtype=np.int64).reshape(-1)
        if model.group_kind(g) in TOKEN_KINDS:
            out.append(_attention_group(plan, g, att_reads, lay_l, la, lay_r, ra, lids, rids,
                                        num_tokens))
            continue
        parts = []
        for read in mamba_reads:
            span = _positions(group.layers, read.layers)
            if span[0] == span[1]:
                continue
            if not isinstance(lay_l, MambaStateLayout) or not isinstance(lay_r, MambaStateLayout):
                raise LayoutError(f"group {g} is Mamba but a rank's layout for it is {lay_l!r} / "
                                  f"{lay_r!r}")
            parts.append(build_mamba_descriptors(read, span, lay_l, la, lay_r, ra, lids, rids))
        out.append(merge_ranges(np.concatenate([d.local_offsets for d in parts] or [[]]),
                                np.concatenate([d.remote_offsets for d in parts] or [[]]),
                                np.concatenate([d.nbytes for d in parts] or [[]])))
    return HybridDescriptors(tuple(out))

"""Simulated engines for the demo, the benchmark and the integration tests.

A model's whole KV cache for one request is a deterministic global tensor
G[layer, kv, token, head, dim] (uint16 = bf16-sized elements). A prefill rank
writes its shard of G into its pool by the ownership rules; after a pull, a
decode rank's pool must hold exactly its shard. Nothing here knows about
descriptors, so it checks the planner and the data path independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.planner import ModelGeometry, Parallelism, heads_per_rank, rank_heads, stage_layers
from kvd.planner.layout import VLLM_LAYOUTS, vllm_head_layout
from kvd.wire.protocol import LayoutSpec, ModelSpec


@dataclass(frozen=True)
class EngineShape:
    tp_size: int
    pp_size: int = 1
    block_size_tokens: int = 16
    num_blocks: int = 128
    kv_layout: str = "kv_split"
    head_layout: str = "HND"


def global_kv(model: ModelSpec, num_tokens: int, seed: int = 1) -> np.ndarray:
    heads = 1 if model.mla else model.num_kv_heads
    kv_parts = 1 if model.mla else 2
    shape = (model.num_layers, kv_parts, num_tokens, heads, model.head_dim)
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    mixed = (idx * np.uint64(2654435761) + np.uint64(seed * 97 + 13)) >> np.uint64(7)
    return (mixed & np.uint64(0xFFFF)).astype(np.uint16).reshape(shape)


def layout_spec(shape: EngineShape) -> LayoutSpec:
    """A vLLM layout name fixes the head order: the spec says it as head_layout, too."""
    head_layout = shape.head_layout
    if shape.kv_layout in VLLM_LAYOUTS:
        head_layout = vllm_head_layout(shape.kv_layout)
    return LayoutSpec(num_blocks=shape.num_blocks, block_size_tokens=shape.block_size_tokens,
                      kv_layout=shape.kv_layout, head_layout=head_layout)


def _geom(model: ModelSpec) -> ModelGeometry:
    return ModelGeometry(model.num_kv_heads, model.num_layers, model.mla)


def blocks_view(pool: np.ndarray, kv_layout: str, head_layout: str,
                 kv_parts: int | None = None) -> np.ndarray:
    """Pool as [block, layer, kv, token, head, dim] (a view, no copy).

    vLLM layouts ("LBHNC", ...) keep K and V in one channel axis, so splitting it needs
    kv_parts (2, or 1 for MLA); without it the view has one kv part holding the whole
    channel, enough to count untouched bytes.
    """
    view = pool.view(np.uint16)
    if kv_layout in VLLM_LAYOUTS:  # the name's axes; head_layout follows from it
        channel = view.shape[-1]
        parts = kv_parts or 1
        view = view.reshape(*view.shape[:-1], parts, channel // parts)
        axes = [*kv_layout[:-1], "kv", "dim"]
        return view.transpose([axes.index(a) for a in ("B", "L", "kv", "N", "H", "dim")])
    if kv_layout == "head_major":  # (nb, H, L, kv, T, D); HND is implied
        return view.transpose(0, 2, 3, 4, 1, 5)
    if kv_layout == "cross_layer":  # (nb, L, kv, ...): already block-major
        pass
    elif kv_layout == "blocks_first":  # (L, nb, kv, ...)
        view = view.transpose(1, 0, 2, 3, 4, 5)
    elif kv_layout == "kv_split":  # (L, kv, nb, ...)
        view = view.transpose(2, 0, 1, 3, 4, 5)
    else:
        raise ValueError(f"unknown kv_layout {kv_layout!r}")
    if head_layout == "HND":  # body (H, T, D) -> (T, H, D)
        view = view.transpose(0, 1, 2, 4, 3, 5)
    return view


def rank_slices(model: ModelSpec, shape: EngineShape, tp_rank: int, pp_rank: int
                ) -> tuple[slice, slice]:
    par = Parallelism(shape.tp_size, shape.pp_size)
    h0, h1 = rank_heads(_geom(model), par, tp_rank)
    l0, l1 = stage_layers(_geom(model), par, pp_rank)
    assert h1 - h0 == heads_per_rank(_geom(model), par)
    return slice(l0, l1), slice(h0, h1)


def write_shard(pool: np.ndarray, g: np.ndarray, model: ModelSpec, shape: EngineShape,
                tp_rank: int, pp_rank: int, block_ids: list[int], first_token: int = 0) -> None:
    """Prefill side: put this rank's cells of tokens [first_token, ...) into its blocks."""
    layers, heads = rank_slices(model, shape, tp_rank, pp_rank)
    view = blocks_view(pool, shape.kv_layout, shape.head_layout, 1 if model.mla else 2)
    bs = shape.block_size_tokens
    for i, b in enumerate(block_ids):
        t0 = first_token + i * bs
        t1 = min(t0 + bs, g.shape[2])
        if t0 >= t1:
            break
        view[b, :, :, : t1 - t0] = g[layers, :, t0:t1, heads, :]


def check_shard(pool: np.ndarray, g: np.ndarray, model: ModelSpec, shape: EngineShape,
                tp_rank: int, pp_rank: int, block_ids: list[int], first_token: int = 0) -> int:
    """Decode side: number of mismatching elements between the pool and the expected shard."""
    layers, heads = rank_slices(model, shape, tp_rank, pp_rank)
    view = blocks_view(pool, shape.kv_layout, shape.head_layout, 1 if model.mla else 2)
    bs = shape.block_size_tokens
    bad = 0
    for i, b in enumerate(block_ids):
        t0 = first_token + i * bs
        t1 = min(t0 + bs, g.shape[2])
        if t0 >= t1:
            break
        bad += int(np.count_nonzero(view[b, :, :, : t1 - t0] != g[layers, :, t0:t1, heads, :]))
    return bad

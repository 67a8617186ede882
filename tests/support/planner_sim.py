"""Byte-level simulator: shard a global KV tensor onto ranks and replay descriptors.

It shares no code with kvd.planner.layout except CacheLayout.shape, so a bug in
the offset arithmetic cannot hide behind the same bug in the checker.
"""

from __future__ import annotations

import numpy as np

from kvd.planner import CacheLayout, Descriptors

DTYPE = np.int32  # 4-byte elements with unique values: any misplaced byte shows


def global_kv(num_layers: int, kv_parts: int, num_tokens: int, num_heads: int,
              head_dim: int) -> np.ndarray:
    """[layer, kv, token, head, dim] with every element distinct (and never -1)."""
    size = num_layers * kv_parts * num_tokens * num_heads * head_dim
    return np.arange(size, dtype=DTYPE).reshape(num_layers, kv_parts, num_tokens, num_heads,
                                                head_dim)


def fill_pool(layout: CacheLayout, kv: np.ndarray, layers: tuple[int, int],
              heads: tuple[int, int], block_ids: np.ndarray) -> np.ndarray:
    """A rank's pool holding its (layers, heads) shard of the request in block_ids."""
    bs = layout.block_size_tokens
    num_tokens = kv.shape[2]
    if layout.vllm:  # logical [L, B, H, N, kv, d], then the name's axis order, K||V channels
        logical = np.full((layout.num_layers, layout.num_blocks, layout.num_heads, bs,
                           layout.kv_parts, layout.head_dim), -1, dtype=DTYPE)
        for i, block in enumerate(block_ids):
            t0, t1 = i * bs, min(num_tokens, (i + 1) * bs)
            data = kv[layers[0]:layers[1], :, t0:t1, heads[0]:heads[1], :]  # [l, kv, t, h, d]
            logical[:, block, :, : t1 - t0] = data.transpose(0, 3, 2, 1, 4)
        phys = logical.transpose([*("LBHN".index(a) for a in layout.kv_layout[:4]), 4, 5])
        return np.ascontiguousarray(phys).reshape(layout.shape)
    assert layout.kv_layout in ("kv_split", "blocks_first", "cross_layer", "head_major"), \
        layout.kv_layout
    pool = np.full(layout.shape, -1, dtype=DTYPE)
    for i, block in enumerate(block_ids):
        t0, t1 = i * bs, min(num_tokens, (i + 1) * bs)
        data = kv[layers[0]:layers[1], :, t0:t1, heads[0]:heads[1], :]  # [l, kv, t, h, d]
        if layout.kv_layout == "head_major":  # pool [block, h, l, kv, t, d]
            pool[block, :, :, :, : t1 - t0, :] = data.transpose(3, 0, 1, 2, 4)
        elif layout.head_layout == "HND":
            data = data.transpose(0, 1, 3, 2, 4)  # [l, kv, h, t, d]
            if layout.kv_layout == "kv_split":
                pool[:, :, block, :, : t1 - t0, :] = data
            elif layout.kv_layout == "blocks_first":
                pool[:, block, :, :, : t1 - t0, :] = data
            else:  # cross_layer
                pool[block, :, :, :, : t1 - t0, :] = data
        elif layout.kv_layout == "kv_split":
            pool[:, :, block, : t1 - t0, :, :] = data
        elif layout.kv_layout == "blocks_first":
            pool[:, block, :, : t1 - t0, :, :] = data
        else:  # cross_layer
            pool[block, :, :, : t1 - t0, :, :] = data
    return pool


def apply_descriptors(desc: Descriptors, local_pool: np.ndarray, remote_pool: np.ndarray,
                      written: np.ndarray) -> None:
    """Copy bytes as NIXL would, counting writes per local byte to catch overlaps."""
    local = local_pool.reshape(-1).view(np.uint8)
    remote = remote_pool.reshape(-1).view(np.uint8)
    n = desc.nbytes
    assert (n > 0).all()
    assert (desc.local_offsets >= 0).all() and (desc.remote_offsets >= 0).all()
    assert (desc.local_offsets + n <= local.size).all()
    assert (desc.remote_offsets + n <= remote.size).all()
    total = int(n.sum())
    within = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    dst = np.repeat(desc.local_offsets, n) + within
    src = np.repeat(desc.remote_offsets, n) + within
    local[dst] = remote[src]
    np.add.at(written, dst, 1)

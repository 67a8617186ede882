"""From a planned Read to byte ranges: NIXL descriptors between two KV pools.

Descriptor size decides transfer speed (4 KiB descriptors move ~10x slower than
1 MiB ones), so the output is merged: every run of chunks that is contiguous on
both sides becomes one descriptor. Chunks are emitted in the local pool's
memory order, which is what makes neighbours adjacent for the merge.

"head_major" puts heads outermost inside a block ([block][head][layer][kv][token]
[dim]): one decode rank's head range of a prefill block, all layers and K/V, is
one contiguous region, so a TP1 -> TP2 pull is one descriptor per block per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError
from kvd.planner.plan import Read

KV_LAYOUTS = ("kv_split", "blocks_first", "cross_layer", "head_major")
HEAD_LAYOUTS = ("HND", "NHD")


@dataclass(frozen=True)
class CacheLayout:
    """Byte layout of ONE engine rank's KV pool: a single contiguous region."""

    num_layers: int  # layers held by this rank (its PP stage)
    num_blocks: int
    block_size_tokens: int
    num_heads: int  # heads held by this rank (1 for MLA)
    head_dim: int
    dtype_nbytes: int
    # "kv_split": [layer][kv][block][body]; "blocks_first": [layer][block][kv][body];
    # "cross_layer": [block][layer][kv][body] (all layers' K and V of a block contiguous;
    # an engine's layer l tensor is the strided view pool[:, l]);
    # "head_major": [block][head][layer][kv][token][head_dim] (a block's heads outermost,
    # each head's layers and K/V contiguous; layer l is the strided view pool[:, :, l])
    kv_layout: str = "kv_split"
    # body "HND": [head][token][head_dim]; "NHD": [token][head][head_dim].
    # head_major has no separate body (heads are above layers): it requires "HND".
    head_layout: str = "HND"
    mla: bool = False  # one latent cache per layer, i.e. kv_parts == 1

    @property
    def kv_parts(self) -> int:
        return 1 if self.mla else 2

    @property
    def block_nbytes(self) -> int:
        """Bytes of one kv part of one block (the body; strided across heads in head_major)."""
        return self.num_heads * self.block_size_tokens * self.head_dim * self.dtype_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.num_layers * self.kv_parts * self.num_blocks * self.block_nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Element shape of the whole pool, for a numpy/torch view."""
        if self.kv_layout == "head_major":
            return (self.num_blocks, self.num_heads, self.num_layers, self.kv_parts,
                    self.block_size_tokens, self.head_dim)
        body = (self.num_heads, self.block_size_tokens, self.head_dim)
        if self.head_layout == "NHD":
            body = (self.block_size_tokens, self.num_heads, self.head_dim)
        if self.kv_layout == "blocks_first":
            return (self.num_layers, self.num_blocks, self.kv_parts, *body)
        if self.kv_layout == "cross_layer":
            return (self.num_blocks, self.num_layers, self.kv_parts, *body)
        return (self.num_layers, self.kv_parts, self.num_blocks, *body)

    @property
    def effective_head_layout(self) -> str:
        """With a single head, NHD and HND are the same bytes; call that HND."""
        return "HND" if self.num_heads == 1 else self.head_layout

    def validate(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size_tokens", "num_heads"):
            if getattr(self, name) < 1:
                raise LayoutError(f"cache layout {name} must be >= 1, got {getattr(self, name)}")
        for name in ("head_dim", "dtype_nbytes"):
            if getattr(self, name) < 1:
                raise LayoutError(f"cache layout {name} must be >= 1, got {getattr(self, name)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise LayoutError(f"unknown kv_layout {self.kv_layout!r}, expected one of {KV_LAYOUTS}")
        if self.head_layout not in HEAD_LAYOUTS:
            raise LayoutError(
                f"unknown head_layout {self.head_layout!r}, expected one of {HEAD_LAYOUTS}"
            )
        if self.kv_layout == "head_major" and self.head_layout != "HND":
            raise LayoutError(
                f"kv_layout head_major needs head_layout HND, got {self.head_layout!r}"
            )
        if self.mla and self.num_heads != 1:
            raise LayoutError(f"MLA cache holds one latent head, got num_heads={self.num_heads}")

    # Byte strides of each logical axis; these are the whole layout definition.
    def strides_nbytes(self) -> dict[str, int]:
        elem = self.head_dim * self.dtype_nbytes
        if self.kv_layout == "head_major":
            token = elem
            kv = self.block_size_tokens * elem
            layer = self.kv_parts * kv
            head = self.num_layers * layer
            return {"layer": layer, "kv": kv, "block": self.num_heads * head, "head": head,
                    "token": token}
        if self.head_layout == "NHD":
            head, token = elem, self.num_heads * elem
        else:
            head, token = self.block_size_tokens * elem, elem
        kv = self.block_nbytes
        if self.kv_layout == "cross_layer":
            layer = self.kv_parts * self.block_nbytes
            block = self.num_layers * layer
        else:
            layer = self.kv_parts * self.num_blocks * self.block_nbytes
            if self.kv_layout == "blocks_first":
                block = self.kv_parts * self.block_nbytes
            else:
                kv, block = self.num_blocks * self.block_nbytes, self.block_nbytes
        return {"layer": layer, "kv": kv, "block": block, "head": head, "token": token}


@dataclass(frozen=True)
class Descriptors:
    """Parallel arrays of byte ranges: local (decode) and remote (prefill) offsets."""

    local_offsets: np.ndarray  # int64
    remote_offsets: np.ndarray  # int64
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())


def _check_pair(read: Read, local: CacheLayout, local_first_layer: int,
                remote: CacheLayout, remote_first_layer: int) -> None:
    local.validate()
    remote.validate()
    if local.mla != remote.mla:
        raise LayoutError("cannot pair an MLA cache with a non-MLA cache")
    if local.head_dim != remote.head_dim:
        raise LayoutError(f"head_dim differs: local {local.head_dim}, remote {remote.head_dim}")
    if local.dtype_nbytes != remote.dtype_nbytes:
        raise LayoutError(
            f"dtype size differs: local {local.dtype_nbytes} B, remote {remote.dtype_nbytes} B"
        )
    (lh0, lh1), (rh0, rh1) = read.local_heads, read.remote_heads
    if not (0 <= lh0 < lh1 <= local.num_heads) or not (0 <= rh0 < rh1 <= remote.num_heads):
        raise LayoutError(
            f"read heads local {read.local_heads} / remote {read.remote_heads} do not fit "
            f"caches of {local.num_heads} / {remote.num_heads} heads"
        )
    if lh1 - lh0 != rh1 - rh0:
        raise LayoutError(
            f"read head ranges differ in size: {read.local_heads} vs {read.remote_heads}"
        )
    l0, l1 = read.layers
    if not (local_first_layer <= l0 < l1 <= local_first_layer + local.num_layers):
        raise LayoutError(f"read layers {read.layers} are not all in the local cache")
    if not (remote_first_layer <= l0 < l1 <= remote_first_layer + remote.num_layers):
        raise LayoutError(f"read layers {read.layers} are not all in the remote cache")
    if local.effective_head_layout != remote.effective_head_layout:
        raise LayoutError(
            f"head layouts differ (local {local.head_layout}, remote {remote.head_layout}): "
            "bytes would need a transpose"
        )
    whole = read.local_heads == (0, local.num_heads) and read.remote_heads == (0, remote.num_heads)
    if local.effective_head_layout == "NHD" and not whole:
        raise LayoutError(
            "NHD caches cannot be head-sliced with byte-range descriptors; "
            "use HND or equal TP (whole-head reads)"
        )


def _segments(local: CacheLayout, remote: CacheLayout, local_ids: np.ndarray,
              remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                               np.ndarray, np.ndarray, int, int]:
    """Pair token segments of min(block sizes) tokens between the two sides.

    Segments are indexed (bigger block, sub-segment) so the caller can put the
    head axis between them; a partial last big block is padded and the
    returned `valid` mask drops the padding. Returns (local block, local token
    offset, remote block, remote token offset, valid, n_sub, segment tokens).
    """
    bs_l, bs_r = local.block_size_tokens, remote.block_size_tokens
    if max(bs_l, bs_r) % min(bs_l, bs_r):
        raise LayoutError(f"block sizes {bs_l} (local) and {bs_r} (remote) do not divide")
    if bs_l >= bs_r:  # local blocks are the big ones: remote j -> local j // n
        n = bs_l // bs_r
        if -(-len(remote_ids) // n) != len(local_ids):
            raise LayoutError(
                f"{len(remote_ids)} remote blocks of {bs_r} tokens do not fill "
                f"{len(local_ids)} local blocks of {bs_l} tokens"
            )
        j = np.arange(len(local_ids) * n)
        valid = j < len(remote_ids)
        rb = remote_ids[np.minimum(j, max(len(remote_ids) - 1, 0))]
        return local_ids[j // n], (j % n) * bs_r, rb, np.zeros_like(j), valid, n, bs_r
    m = bs_r // bs_l  # remote blocks are the big ones: local k <- remote k // m
    if -(-len(local_ids) // m) != len(remote_ids):
        raise LayoutError(
            f"{len(local_ids)} local blocks of {bs_l} tokens do not match "
            f"{len(remote_ids)} remote blocks of {bs_r} tokens"
        )
    k = np.arange(len(remote_ids) * m)
    valid = k < len(local_ids)
    lb = local_ids[np.minimum(k, max(len(local_ids) - 1, 0))]
    return lb, np.zeros_like(k), remote_ids[k // m], (k % m) * bs_l, valid, m, bs_l


# Chunk enumeration order per local kv_layout, outermost first: its memory order.
_AXIS_ORDER = {
    "kv_split": ("layer", "kv", "big", "head", "sub"),
    "blocks_first": ("layer", "big", "kv", "head", "sub"),
    "cross_layer": ("big", "layer", "kv", "head", "sub"),
    "head_major": ("big", "head", "layer", "kv", "sub"),
}


def _merge(lo: np.ndarray, ro: np.ndarray, chunk_nbytes: int) -> Descriptors:
    """Collapse runs of equal-size chunks that are contiguous on both sides."""
    if lo.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    breaks = (np.diff(lo) != chunk_nbytes) | (np.diff(ro) != chunk_nbytes)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    run_chunks = np.diff(np.append(starts, lo.size))
    return Descriptors(lo[starts], ro[starts], run_chunks.astype(np.int64) * chunk_nbytes)


def build_read_descriptors(read: Read, local: CacheLayout, local_first_layer: int,
                           remote: CacheLayout, remote_first_layer: int,
                           local_block_ids: np.ndarray,
                           remote_block_ids: np.ndarray) -> Descriptors:
    """Byte ranges that move one Read's cells of one request into the decode pool.

    Chunks are one (layer, kv, segment) when the head range is contiguous on
    both sides (HND with equal block sizes, or whole-head NHD), else one
    (layer, kv, segment, head) (always when a side is head_major; both
    head_major with equal block sizes: one (head, block) spanning the read's
    layers and K/V); the axis order follows the local pool so that the merge
    finds its neighbours. Both cross_layer (or both head_major), equal block
    sizes and a read of all layers and heads of both ranks: one descriptor per
    block (or per run of consecutive blocks). Both head_major and all layers
    of both ranks: one descriptor per block for any head range (a TP1 -> TP2
    pull included).
    """
    _check_pair(read, local, local_first_layer, remote, remote_first_layer)
    local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    for name, ids, lay in (("local", local_ids, local), ("remote", remote_ids, remote)):
        if ids.size and (ids.min() < 0 or ids.max() >= lay.num_blocks):
            raise LayoutError(f"{name} block id out of range [0, {lay.num_blocks})")
    if local_ids.size == 0 or remote_ids.size == 0:
        if local_ids.size != remote_ids.size:
            raise LayoutError("one side has block ids and the other has none")
        return _merge(local_ids, remote_ids, 1)

    lb, lt, rb, rt, valid, n_sub, seg_tokens = _segments(local, remote, local_ids, remote_ids)
    ls, rs = local.strides_nbytes(), remote.strides_nbytes()
    n_heads = read.local_heads[1] - read.local_heads[0]
    elem = local.head_dim * local.dtype_nbytes
    equal_blocks = local.block_size_tokens == remote.block_size_tokens
    head_major = "head_major" in (local.kv_layout, remote.kv_layout)
    if local.effective_head_layout == "NHD":  # whole heads, checked: token rows are contiguous
        per_head, chunk = False, seg_tokens * local.num_heads * elem
    elif equal_blocks and not head_major:  # HND: [head][token] of a whole block, heads adjacent
        per_head, chunk = False, n_heads * seg_tokens * elem
    else:  # HND with a block-size ratio, or head_major: one head's tokens at a time
        per_head, chunk = True, seg_tokens * elem
    head_idx = np.arange(n_heads if per_head else 1, dtype=np.int64)

    n_layers = read.layers[1] - read.layers[0]
    # Both head_major, equal blocks: one head's layer range x K/V x tokens is one run on
    # both sides, so make it the chunk (n_layers * kv_parts fewer chunks to merge).
    fold = local.kv_layout == remote.kv_layout == "head_major" and equal_blocks
    if fold:
        chunk *= n_layers * local.kv_parts
    n_layer_idx, n_kv_idx = (1, 1) if fold else (n_layers, local.kv_parts)
    n_big = lb.size // n_sub
    sides = []
    for s, first, blocks, tokens, heads0 in (
        (ls, local_first_layer, lb, lt, read.local_heads[0]),
        (rs, remote_first_layer, rb, rt, read.remote_heads[0]),
    ):
        layer = (read.layers[0] - first + np.arange(n_layer_idx, dtype=np.int64)) * s["layer"]
        kv = np.arange(n_kv_idx, dtype=np.int64) * s["kv"]
        seg = (blocks * s["block"] + tokens * s["token"]).reshape(n_big, n_sub)
        head = (heads0 + head_idx) * s["head"]
        sides.append((layer, kv, seg, head))

    # Enumerate chunks in the local pool's memory order so that neighbours in memory
    # are neighbours in the list. Any order is correct (each chunk pairs the same
    # (layer, kv, segment, head) on both sides); only the merge depends on it.
    order = _AXIS_ORDER[local.kv_layout]
    sizes = {"layer": n_layer_idx, "kv": n_kv_idx, "big": n_big, "head": head_idx.size,
             "sub": n_sub}
    full = tuple(sizes[a] for a in order)

    def place(values: np.ndarray, *axes: str) -> np.ndarray:
        # "big" precedes "sub" in every order, so a C-order (big, sub) array reshapes in place
        shape = [1] * len(order)
        for a in axes:
            shape[order.index(a)] = sizes[a]
        return values.reshape(shape)

    def grid(layer, kv, seg, head):
        return (place(layer, "layer") + place(kv, "kv") + place(seg, "big", "sub")
                + place(head, "head"))

    mask = np.broadcast_to(place(valid, "big", "sub"), full)
    lo = grid(*sides[0]).reshape(-1)
    ro = grid(*sides[1]).reshape(-1)
    if not valid.all():
        keep = mask.reshape(-1)
        lo, ro = lo[keep], ro[keep]
    return _merge(lo, ro, chunk)

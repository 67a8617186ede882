"""From a planned Read to byte ranges: NIXL descriptors between two KV pools.

Descriptor size decides transfer speed (4 KiB descriptors move ~10x slower than
1 MiB ones), so the output is merged: every run of chunks that is contiguous on
both sides becomes one descriptor. Chunks are emitted in the local pool's
memory order, which is what makes neighbours adjacent for the merge.

"head_major" puts heads outermost inside a block ([block][head][layer][kv][token]
[dim]): one decode rank's head range of a prefill block, all layers and K/V, is
one contiguous region, so a TP1 -> TP2 pull is one descriptor per block per rank.

vLLM's own layouts (VLLM_LAYOUTS, the names of vllm/v1/kv_cache_layout.py) are
spelled by their axes outermost first: L layer, B block, H head, N token and C
the channel, K and V of one (head, token) side by side (MLA: the latent). With K
and V interleaved, a chunk never splits a channel; the rest is the same stride
model, so head and token slices come out of the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError
from kvd.planner.plan import Read

KV_LAYOUTS = ("kv_split", "blocks_first", "cross_layer", "head_major")
# vLLM 0.32's KVCacheLayout members: one rank's pool is one region in this axis order.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
ALL_KV_LAYOUTS = KV_LAYOUTS + VLLM_LAYOUTS
HEAD_LAYOUTS = ("HND", "NHD")


def vllm_head_layout(kv_layout: str) -> str:
    """The body order a vLLM layout name implies: tokens outside heads is NHD."""
    return "NHD" if kv_layout.index("N") < kv_layout.index("H") else "HND"


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
    # vLLM names ("LBHNC", ...; VLLM_LAYOUTS) fix the order of H and N themselves, and
    # head_layout must agree with the name (vllm_head_layout) so that the compatibility
    # hash, which includes it, cannot tell two spellings of the same bytes apart.
    head_layout: str = "HND"
    mla: bool = False  # one latent cache per layer, i.e. kv_parts == 1

    @property
    def kv_parts(self) -> int:
        return 1 if self.mla else 2

    @property
    def vllm(self) -> bool:
        """K and V of one (head, token) adjacent: one of vLLM's layouts."""
        return self.kv_layout in VLLM_LAYOUTS

    @property
    def channel_nbytes(self) -> int:
        """Bytes of one (layer, block, head, token) run: K and V together in vLLM's layouts
        (the smallest piece a descriptor may cut), one kv part's head_dim otherwise."""
        return (self.kv_parts if self.vllm else 1) * self.head_dim * self.dtype_nbytes

    def _vllm_sizes(self) -> dict[str, int]:
        return {"L": self.num_layers, "B": self.num_blocks, "H": self.num_heads,
                "N": self.block_size_tokens, "C": self.kv_parts * self.head_dim}

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
        if self.vllm:  # the name's axes in its order; C is K then V (MLA: the latent)
            size = self._vllm_sizes()
            return tuple(size[axis] for axis in self.kv_layout)
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
        if self.num_heads == 1:
            return "HND"
        return vllm_head_layout(self.kv_layout) if self.vllm else self.head_layout

    def validate(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size_tokens", "num_heads"):
            if getattr(self, name) < 1:
                raise LayoutError(f"cache layout {name} must be >= 1, got {getattr(self, name)}")
        for name in ("head_dim", "dtype_nbytes"):
            if getattr(self, name) < 1:
                raise LayoutError(f"cache layout {name} must be >= 1, got {getattr(self, name)}")
        if self.kv_layout not in ALL_KV_LAYOUTS:
            raise LayoutError(
                f"unknown kv_layout {self.kv_layout!r}, expected one of {ALL_KV_LAYOUTS}"
            )
        if self.head_layout not in HEAD_LAYOUTS:
            raise LayoutError(
                f"unknown head_layout {self.head_layout!r}, expected one of {HEAD_LAYOUTS}"
            )
        if self.kv_layout == "head_major" and self.head_layout != "HND":
            raise LayoutError(
                f"kv_layout head_major needs head_layout HND, got {self.head_layout!r}"
            )
        if self.vllm and self.head_layout != vllm_head_layout(self.kv_layout):
            raise LayoutError(
                f"kv_layout {self.kv_layout} is {vllm_head_layout(self.kv_layout)} inside a "
                f"block: set head_layout {vllm_head_layout(self.kv_layout)}, "
                f"got {self.head_layout!r}"
            )
        if self.mla and self.num_heads != 1:
            raise LayoutError(f"MLA cache holds one latent head, got num_heads={self.num_heads}")

    # Byte strides of each logical axis; these are the whole layout definition.
    def strides_nbytes(self) -> dict[str, int]:
        elem = self.head_dim * self.dtype_nbytes
        if self.vllm:  # dense in the name's order; "kv" is V's offset inside the channel
            size, stride, strides = self._vllm_sizes(), self.channel_nbytes, {}
            for axis in reversed(self.kv_layout[:-1]):  # C is innermost in every name
                strides[axis] = stride
                stride *= size[axis]
            return {"layer": strides["L"], "kv": elem, "block": strides["B"],
                    "head": strides["H"], "token": strides["N"]}
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
    if not local.mla and local.vllm != remote.vllm:
        v, other = (local, remote) if local.vllm else (remote, local)
        raise LayoutError(
            f"K and V sit side by side in {v.kv_layout} but apart in {other.kv_layout}: "
            "bytes would need de-interleaving"
        )
    if local.vllm or remote.vllm:
        # A single-head side has one order; any other pair of orders needs a transpose.
        if (local.num_heads > 1 and remote.num_heads > 1
                and local.effective_head_layout != remote.effective_head_layout):
            raise LayoutError(
                f"head layouts differ (local {local.kv_layout}, remote {remote.kv_layout}): "
                "bytes would need a transpose"
            )
        return  # token-major (NH) head slices: one descriptor per token, see _chunking
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


def _chunking(ls: dict[str, int], rs: dict[str, int], elem: int, n_heads: int,
              seg_tokens: int) -> tuple[int, int, int]:
    """(chunk bytes, head-axis size, token-axis size): the biggest piece both sides hold
    contiguously in the same order, of one (layer, kv, segment).

    Decided by strides, not names, so that every pair of layouts (one of them with a
    single head included) gets the same test: a segment's heads x tokens as one run,
    token-major or head-major; else one head's tokens; else one token's heads (vLLM's
    NH layouts cut to a head range: one descriptor per token).
    """
    sides = (ls, rs)
    heads_run = n_heads == 1 or all(s["head"] == elem for s in sides)
    tokens_run = all(s["token"] == elem for s in sides)
    if heads_run and all(s["token"] == n_heads * elem for s in sides):  # [token][head]
        return n_heads * seg_tokens * elem, 1, 1
    if tokens_run and (n_heads == 1 or all(s["head"] == seg_tokens * elem for s in sides)):
        return n_heads * seg_tokens * elem, 1, 1  # [head][token]
    if tokens_run:
        return seg_tokens * elem, n_heads, 1
    if heads_run:
        return n_heads * elem, 1, seg_tokens
    raise LayoutError("the two caches order heads and tokens differently: no byte-range form")


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
# "big"/"sub" are the segment (bigger block, sub-segment), "tok" a token inside it.
_AXIS_ORDER = {
    "kv_split": ("layer", "kv", "big", "head", "sub", "tok"),
    "blocks_first": ("layer", "big", "kv", "head", "sub", "tok"),
    "cross_layer": ("big", "layer", "kv", "head", "sub", "tok"),
    "head_major": ("big", "head", "layer", "kv", "sub", "tok"),
    "LBHNC": ("layer", "kv", "big", "head", "sub", "tok"),
    "LBNHC": ("layer", "kv", "big", "sub", "tok", "head"),
    "LHBNC": ("layer", "kv", "head", "big", "sub", "tok"),
    "BLHNC": ("big", "layer", "kv", "head", "sub", "tok"),
    "BLNHC": ("big", "layer", "kv", "sub", "tok", "head"),
    "BHLNC": ("big", "head", "layer", "kv", "sub", "tok"),
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
    pull included). vLLM's layouts go through the same path with K||V as the
    element (`_chunking` decides by strides); BHLNC behaves as head_major, and
    an NH name (LBNHC, BLNHC) cut to a head range is one descriptor per token.
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
    # vLLM layouts carry K and V inside the channel (one kv index); MLA pairs of a vLLM
    # and a split layout agree anyway: one part, channel == head_dim.
    elem = local.channel_nbytes
    n_kv = 1 if local.vllm else local.kv_parts
    chunk, n_head_idx, n_tok = _chunking(ls, rs, elem, n_heads, seg_tokens)

    n_layers = read.layers[1] - read.layers[0]
    # Where a chunk's K/V parts and layers follow each other on both sides (head_major or
    # BHLNC with equal block sizes: one head's layer range x K/V x tokens) take them as one
    # chunk from the start: n_layers * n_kv fewer chunks to merge.
    fold = all(s["layer"] == n_kv * chunk and (n_kv == 1 or s["kv"] == chunk)
               for s in (ls, rs))
    if fold:
        chunk *= n_layers * n_kv
    n_layer_idx, n_kv_idx = (1, 1) if fold else (n_layers, n_kv)
    n_big = lb.size // n_sub
    head_idx = np.arange(n_head_idx, dtype=np.int64)
    tok_idx = np.arange(n_tok, dtype=np.int64)
    sides = []
    for s, first, blocks, tokens, heads0 in (
        (ls, local_first_layer, lb, lt, read.local_heads[0]),
        (rs, remote_first_layer, rb, rt, read.remote_heads[0]),
    ):
        layer = (read.layers[0] - first + np.arange(n_layer_idx, dtype=np.int64)) * s["layer"]
        kv = np.arange(n_kv_idx, dtype=np.int64) * s["kv"]
        seg = (blocks * s["block"] + tokens * s["token"]).reshape(n_big, n_sub)
        head = (heads0 + head_idx) * s["head"]
        sides.append((layer, kv, seg, head, tok_idx * s["token"]))

    # Enumerate chunks in the local pool's memory order so that neighbours in memory
    # are neighbours in the list. Any order is correct (each chunk pairs the same
    # (layer, kv, segment, head) on both sides); only the merge depends on it.
    order = _AXIS_ORDER[local.kv_layout]
    sizes = {"layer": n_layer_idx, "kv": n_kv_idx, "big": n_big, "head": n_head_idx,
             "sub": n_sub, "tok": n_tok}
    full = tuple(sizes[a] for a in order)

    def place(values: np.ndarray, *axes: str) -> np.ndarray:
        # "big" precedes "sub" in every order, so a C-order (big, sub) array reshapes in place
        shape = [1] * len(order)
        for a in axes:
            shape[order.index(a)] = sizes[a]
        return values.reshape(shape)

    def grid(layer, kv, seg, head, tok):
        return (place(layer, "layer") + place(kv, "kv") + place(seg, "big", "sub")
                + place(head, "head") + place(tok, "tok"))

    mask = np.broadcast_to(place(valid, "big", "sub"), full)
    lo = grid(*sides[0]).reshape(-1)
    ro = grid(*sides[1]).reshape(-1)
    if not valid.all():
        keep = mask.reshape(-1)
        lo, ro = lo[keep], ro[keep]
    return _merge(lo, ro, chunk)

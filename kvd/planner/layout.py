"""Byte layout of one engine rank's KV pool (`CacheLayout`): shapes and strides.

Descriptors between two layouts are built by kvd.planner.descriptors.

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

from kvd.errors import LayoutError

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

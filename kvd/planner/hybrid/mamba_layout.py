"""Mamba state bytes: where a rank keeps its states, and the descriptors that move a MambaRead.

Split from mamba.py (who holds what) the way layout.py is split from plan.py:
a layout is per rank and per group, the read is per engine pair. Chunks differ
in size (x, B, C, SSM), so merging sorts by local offset instead of relying on
an enumeration order, and joins what is contiguous on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError
from kvd.planner.descriptors import Descriptors
from kvd.planner.hybrid.mamba import MambaRankShape, MambaRead, MambaSpec, mamba_rank_shape

CONV_LAYOUTS = ("DS", "SD")


@dataclass(frozen=True)
class MambaStateLayout:
    """Where one rank keeps one KV-cache group's Mamba states, as byte offsets in its pool.

    The state of (layer i, slot s) starts at base + i * layer_stride +
    s * slot_stride; inside it the conv state sits at conv_offset and the SSM
    state at ssm_offset. The defaults are dense and layer-major ([layer][slot]
    [conv | ssm]); vLLM's hybrid pools (one tensor per layer position shared
    with attention, slots of blocks_per_logical attention pages) and
    slot-major pools are the same fields with other values.
    """

    spec: MambaSpec
    tp_size: int
    num_layers: int  # this group's Mamba layers on this rank's stage
    num_blocks: int  # state slots; a request's block id for this group names one
    conv_layout: str = "DS"  # "DS": (conv_channels, state_len); "SD": (state_len, conv_channels)
    base_offset_nbytes: int = 0
    slot_stride_nbytes: int | None = None  # None: the state's size
    layer_stride_nbytes: int | None = None  # None: num_blocks * slot stride
    conv_offset_nbytes: int = 0
    ssm_offset_nbytes: int | None = None  # None: right after the conv state

    @property
    def shape(self) -> MambaRankShape:
        return mamba_rank_shape(self.spec, self.tp_size)

    @property
    def ssm_offset(self) -> int:
        if self.ssm_offset_nbytes is None:
            return self.conv_offset_nbytes + self.shape.conv_nbytes
        return self.ssm_offset_nbytes

    @property
    def state_extent_nbytes(self) -> int:
        """Bytes from a state's start to the end of its last part."""
        shape = self.shape
        return max(self.conv_offset_nbytes + shape.conv_nbytes, self.ssm_offset + shape.ssm_nbytes)

    @property
    def slot_stride(self) -> int:
        if self.slot_stride_nbytes is None:
            return self.state_extent_nbytes
        return self.slot_stride_nbytes

    @property
    def layer_stride(self) -> int:
        if self.layer_stride_nbytes is None:
            return self.num_blocks * self.slot_stride
        return self.layer_stride_nbytes

    @property
    def end_nbytes(self) -> int:
        """One past the last byte of the last state: the pool must be at least this big."""
        return (self.base_offset_nbytes + (self.num_layers - 1) * self.layer_stride
                + (self.num_blocks - 1) * self.slot_stride + self.state_extent_nbytes)

    def validate(self) -> None:
        self.spec.validate()
        for name in ("num_layers", "num_blocks"):
            if getattr(self, name) < 1:
                raise LayoutError(f"Mamba layout {name} must be >= 1, got {getattr(self, name)}")
        if self.conv_layout not in CONV_LAYOUTS:
            raise LayoutError(f"unknown conv_layout {self.conv_layout!r}, expected one of "
                              f"{CONV_LAYOUTS}")
        shape = self.shape
        conv = (self.conv_offset_nbytes, self.conv_offset_nbytes + shape.conv_nbytes)
        ssm = (self.ssm_offset, self.ssm_offset + shape.ssm_nbytes)
        if min(conv[0], ssm[0], self.base_offset_nbytes) < 0:
            raise LayoutError("Mamba layout offsets must be >= 0")
        if conv[0] < ssm[1] and ssm[0] < conv[1]:
            raise LayoutError(f"Mamba conv state {conv} and SSM state {ssm} overlap")
        extent, ls, ss = self.state_extent_nbytes, self.layer_stride, self.slot_stride
        # states of different (layer, slot) must not overlap: one axis nests inside the other
        slots_in_layers = ss >= extent and ls >= (self.num_blocks - 1) * ss + extent
        layers_in_slots = ls >= extent and ss >= (self.num_layers - 1) * ls + extent
        if not (slots_in_layers or layers_in_slots or
                (self.num_layers == 1 and ss >= extent) or (self.num_blocks == 1 and ls >= extent)):
            raise LayoutError(f"Mamba layout strides (layer {ls} B, slot {ss} B) overlap states "
                              f"of {extent} B")


def merge_ranges(lo: np.ndarray, ro: np.ndarray, nbytes: np.ndarray) -> Descriptors:
    """Sort chunks by local offset and join those contiguous on both sides.

    The attention merge (kvd.planner.descriptors) needs equal-size chunks in memory
    order; Mamba chunks differ in size (x, B, C, SSM) and come from several layouts,
    so sort first.
    """
    lo, ro, nbytes = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (lo, ro, nbytes))
    if lo.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Descriptors(empty, empty.copy(), empty.copy())
    order = np.argsort(lo, kind="stable")
    lo, ro, nbytes = lo[order], ro[order], nbytes[order]
    joined = (lo[:-1] + nbytes[:-1] == lo[1:]) & (ro[:-1] + nbytes[:-1] == ro[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    return Descriptors(lo[starts], ro[starts], np.add.reduceat(nbytes, starts))


def _chunk_templates(read: MambaRead, local: MambaStateLayout,
                     remote: MambaStateLayout) -> np.ndarray:
    """(local offset, remote offset, nbytes) of the read's pieces inside one state."""
    ls, rs = local.shape, remote.shape
    p, n = ls.head_dim, ls.d_state
    # conv parts in channels: (local first channel, remote first channel, channels)
    heads = read.local_heads[1] - read.local_heads[0]
    parts = [(read.local_heads[0] * p, read.remote_heads[0] * p, heads * p)]
    if read.groups is not None and read.local_groups and read.remote_groups:
        count = (read.local_groups[1] - read.local_groups[0]) * n
        lb = ls.x_channels + read.local_groups[0] * n
        rb = rs.x_channels + read.remote_groups[0] * n
        parts += [(lb, rb, count), (lb + ls.group_channels, rb + rs.group_channels, count)]
    ec, steps = ls.conv_dtype_nbytes, ls.state_len
    lc, rc = local.conv_offset_nbytes, remote.conv_offset_nbytes
    rows = []
    for l_ch, r_ch, count in parts:
        if local.conv_layout == "DS":  # a channel's state_len steps are contiguous
            rows.append((lc + l_ch * steps * ec, rc + r_ch * steps * ec, count * steps * ec))
        else:  # SD: one run of channels per step
            rows += [(lc + (s * ls.conv_channels + l_ch) * ec,
                      rc + (s * rs.conv_channels + r_ch) * ec, count * ec) for s in range(steps)]
    head_nbytes = ls.ssm_head_nbytes
    rows.append((local.ssm_offset + read.local_heads[0] * head_nbytes,
                 remote.ssm_offset + read.remote_heads[0] * head_nbytes, heads * head_nbytes))
    return np.asarray(rows, dtype=np.int64)


def build_mamba_descriptors(read: MambaRead, layers: tuple[int, int],
                            local: MambaStateLayout, local_first_layer: int,
                            remote: MambaStateLayout, remote_first_layer: int,
                            local_block_ids: np.ndarray,
                            remote_block_ids: np.ndarray) -> Descriptors:
    """Byte ranges that move one MambaRead's slices of `layers` between paired state slots.

    `layers` and the first-layer arguments are in the group's own layer
    numbering (its i-th Mamba layer), which is how the layouts count them;
    slot local_block_ids[i] receives remote_block_ids[i]. Per (layer, slot):
    x, B, C and the SSM head slice, merged where contiguous on both sides
    (whole states of equal TP become one run per layer and slot, or one in all
    for consecutive slot-major slots).
    """
    local.validate()
    remote.validate()
    if local.spec != remote.spec:
        raise LayoutError(f"Mamba specs differ: local {local.spec}, remote {remote.spec}")
    if local.conv_layout != remote.conv_layout:
        raise LayoutError(f"conv state layouts differ (local {local.conv_layout}, remote "
                          f"{remote.conv_layout}): bytes would need a transpose")
    lh, rh = read.local_heads, read.remote_heads
    ls, rs = local.shape, remote.shape
    if not (0 <= lh[0] < lh[1] <= ls.heads and 0 <= rh[0] < rh[1] <= rs.heads) or \
            lh[1] - lh[0] != rh[1] - rh[0]:
        raise LayoutError(f"Mamba read heads local {lh} / remote {rh} do not fit ranks of "
                          f"{ls.heads} / {rs.heads} heads")
    if read.groups is not None:
        lg, rg = read.local_groups or (0, 0), read.remote_groups or (0, 0)
        if not (0 <= lg[0] < lg[1] <= ls.groups and 0 <= rg[0] < rg[1] <= rs.groups) or \
                lg[1] - lg[0] != rg[1] - rg[0]:
            raise LayoutError(f"Mamba read groups local {lg} / remote {rg} do not fit ranks of "
                              f"{ls.groups} / {rs.groups} groups")
    l0, l1 = layers
    if not (local_first_layer <= l0 <= l1 <= local_first_layer + local.num_layers):
        raise LayoutError(f"Mamba layers {layers} are not all in the local layout")
    if not (remote_first_layer <= l0 <= l1 <= remote_first_layer + remote.num_layers):
        raise LayoutError(f"Mamba layers {layers} are not all in the remote layout")
    local_ids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
    if local_ids.size != remote_ids.size:
        raise LayoutError(f"Mamba slots pair one to one: {local_ids.size} local vs "
                          f"{remote_ids.size} remote block ids")
    for name, ids, lay in (("local", local_ids, local), ("remote", remote_ids, remote)):
        if ids.size and (ids.min() < 0 or ids.max() >= lay.num_blocks):
            raise LayoutError(f"{name} Mamba block id out of range [0, {lay.num_blocks})")
    if l0 == l1 or local_ids.size == 0:
        return merge_ranges(np.zeros(0), np.zeros(0), np.zeros(0))

    layer_idx = np.arange(l0, l1, dtype=np.int64)
    bases = []
    for lay, first, ids in ((local, local_first_layer, local_ids),
                            (remote, remote_first_layer, remote_ids)):
        base = (lay.base_offset_nbytes + (layer_idx - first)[:, None] * lay.layer_stride
                + ids[None, :] * lay.slot_stride)
        bases.append(base.reshape(-1, 1))
    tmpl = _chunk_templates(read, local, remote)
    lo = bases[0] + tmpl[None, :, 0]
    ro = bases[1] + tmpl[None, :, 1]
    nbytes = np.broadcast_to(tmpl[None, :, 2], lo.shape)
    return merge_ranges(lo, ro, nbytes)

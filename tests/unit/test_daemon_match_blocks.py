"""match_blocks: which remote blocks feed the local ones (prefix hits, block-size ratios)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import LayoutError
from kvd.planner.blocks import match_blocks


def m(local, remote, lbs, rbs):
    lo, re = match_blocks(local, remote, lbs, rbs)
    assert lo.dtype == np.int64 and re.dtype == np.int64
    return lo.tolist(), re.tolist()


def test_same_size_full_and_prefix_hit() -> None:
    assert m([7, 8, 9], [1, 2, 3], 16, 16) == ([7, 8, 9], [1, 2, 3])
    assert m([9], [1, 2, 3], 16, 16) == ([9], [3])  # prefix hit: only the tail
    assert m([8, 9], [1, 2, 3], 16, 16) == ([8, 9], [2, 3])


def test_zero_local_blocks_is_notify_only() -> None:
    assert m([], [1, 2, 3], 16, 16) == ([], [])
    assert m([], [], 16, 32) == ([], [])


def test_decode_blocks_larger() -> None:
    # 4 prefill blocks of 16 -> 2 decode blocks of 32
    assert m([5, 6], [1, 2, 3, 4], 32, 16) == ([5, 6], [1, 2, 3, 4])
    # 5 prefill blocks: the last decode block is partial
    assert m([5, 6, 7], [1, 2, 3, 4, 9], 32, 16) == ([5, 6, 7], [1, 2, 3, 4, 9])
    # prefix hit of one decode block: skip two prefill blocks
    assert m([6, 7], [1, 2, 3, 4, 9], 32, 16) == ([6, 7], [3, 4, 9])


def test_prefill_blocks_larger() -> None:
    # 2 prefill blocks of 32 -> 4 decode blocks of 16
    assert m([5, 6, 7, 8], [1, 2], 16, 32) == ([5, 6, 7, 8], [1, 2])
    # decode names 3 blocks for a partial last prefill block
    assert m([5, 6, 7], [1, 2], 16, 32) == ([5, 6, 7], [1, 2])
    # prefix hit covering whole prefill blocks
    assert m([7, 8], [1, 2], 16, 32) == ([7, 8], [2])


def test_errors() -> None:
    with pytest.raises(LayoutError, match="no remote blocks"):
        match_blocks([1], [], 16, 16)
    with pytest.raises(LayoutError, match="only fills"):
        match_blocks([1, 2, 3], [1, 2], 16, 16)
    with pytest.raises(LayoutError, match="not a multiple"):
        match_blocks([1], [1], 24, 16)
    with pytest.raises(LayoutError, match="not a multiple"):
        match_blocks([1], [1], 16, 24)
    with pytest.raises(LayoutError, match="only"):
        match_blocks([1, 2, 3, 4, 5], [1, 2], 16, 32)
    with pytest.raises(LayoutError, match="whole prefill blocks"):
        match_blocks([7], [1, 2], 16, 32)  # half a prefill block out of the middle


def test_accepts_numpy_and_nested_input() -> None:
    lo, re = match_blocks(np.array([[3, 4]]), np.array([1, 2]), 16, 16)
    assert lo.tolist() == [3, 4] and re.tolist() == [1, 2]

"""Which remote blocks feed which local blocks for one request.

vLLM's semantics: the decode side names fewer blocks than the prefill side
when it already holds a prefix (prefix-cache hit), so only the tail is read;
no local blocks means "notify only". Block sizes may differ: decode blocks a
multiple of prefill blocks (vLLM's direction) or the reverse.
"""

from __future__ import annotations

import numpy as np

from kvd.errors import LayoutError


def match_blocks(local_ids: list[int] | np.ndarray, remote_ids: list[int] | np.ndarray,
                 local_block_tokens: int, remote_block_tokens: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Trim the remote ids to the tail the local ids receive; arrays for build_read_descriptors."""
    local = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if local.size == 0:
        return local, remote[:0]
    if remote.size == 0:
        raise LayoutError("pull names local blocks but no remote blocks")
    if local_block_tokens >= remote_block_tokens:
        if local_block_tokens % remote_block_tokens:
            raise LayoutError(f"decode block size {local_block_tokens} is not a multiple of "
                              f"prefill block size {remote_block_tokens}")
        ratio = local_block_tokens // remote_block_tokens
        # Remote blocks grouped into decode-sized groups; the last may be partial.
        groups = -(-remote.size // ratio)
        skip_groups = groups - local.size
        if skip_groups < 0:
            raise LayoutError(f"pull names {local.size} local blocks but the remote request "
                              f"only fills {groups}")
        return local, remote[skip_groups * ratio:]
    if remote_block_tokens % local_block_tokens:
        raise LayoutError(f"prefill block size {remote_block_tokens} is not a multiple of "
                          f"decode block size {local_block_tokens}")
    ratio = remote_block_tokens // local_block_tokens
    need = -(-local.size // ratio)
    if need > remote.size:
        raise LayoutError(f"pull names {local.size} local blocks but the remote request has only "
                          f"{remote.size} blocks of {ratio}x the size")
    if local.size % ratio and need < remote.size:
        raise LayoutError("a prefix hit with a larger prefill block size must cover whole "
                          "prefill blocks")
    return local, remote[remote.size - need:]

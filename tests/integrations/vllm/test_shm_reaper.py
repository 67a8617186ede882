"""The vLLM suite's end-of-session reaper removes the vLLM shared-memory segments
(``psm_*``) that killed engines left, and never one a live process still maps."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from shm_reaper import SHM_DIR, reap_vllm_segments

pytestmark = pytest.mark.vllm


def test_unmapped_new_segments_go_and_mapped_or_older_ones_stay():
    tag = f"psm_kvdtest_{os.getpid()}_"
    paths = {n: SHM_DIR / f"{tag}{n}" for n in ("left", "mapped", "older")}
    for p in paths.values():
        p.write_bytes(b"\0" * 4096)
    try:
        with open(paths["mapped"], "r+b") as f, mmap.mmap(f.fileno(), 4096):
            removed = reap_vllm_segments({paths["older"].name}, pattern=f"{tag}*")
            assert removed == [paths["left"].name]
            assert not paths["left"].exists()
            assert paths["mapped"].exists() and paths["older"].exists()
    finally:
        for p in paths.values():
            Path(p).unlink(missing_ok=True)

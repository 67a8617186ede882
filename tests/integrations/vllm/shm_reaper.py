"""vLLM's shared-memory message queues (``psm_*`` in /dev/shm) that engines killed by a
test leave behind, found and removed (the vLLM suite's end of session)."""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def _mapped_shm_files() -> set[str]:
    """Names of /dev/shm files some live process has open or mapped."""
    names: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.rsplit("/dev/shm/", 1)[1].split(" ")[0].strip()
                             for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/"):])
        except OSError:
            continue
    return names


def reap_vllm_segments(before: set[str], shm_dir: Path = SHM_DIR,
                       pattern: str = "psm_*") -> list[str]:
    """vLLM's shared-memory message queues (``psm_*``) made since ``before`` that no
    live process maps any more: what engines killed by a test left (400 MB seen)."""
    live = _mapped_shm_files()
    removed = []
    for path in shm_dir.glob(pattern):
        if path.name not in before and path.name not in live:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed

"""A stand-in daemon incarnation for pool-ownership tests, and a scratch shm_dir.

The stand-in takes its owner lock, makes pools (the first starts with bytes 1, 2, 3,
4), prints its owner id and the pool names, and waits to be killed: killing it makes
its pools a dead incarnation's, which the reaper and adoption act on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_STANDIN = textwrap.dedent("""
    import sys, time
    from kvd.pool.shm import ShmPool
    from kvd.pool.owner import PoolOwner
    directory, prefix, nbytes, count, pool_dir = sys.argv[1:6]
    owner = PoolOwner.acquire(directory, prefix)
    pools = [ShmPool.create(prefix, int(nbytes), pool_dir or directory, owner=owner)
             for _ in range(int(count))]
    pools[0].array[:4] = [1, 2, 3, 4]
    print(owner.owner_id, *[p.name for p in pools], flush=True)
    time.sleep(120)
""")


def start_standin(directory: Path, prefix: str, nbytes: int = 1 << 20, count: int = 2,
                  pool_dir: Path | None = None
                  ) -> tuple[subprocess.Popen, str, list[str]]:
    """(process, owner id, pool names); pools go to ``pool_dir`` (default: directory,
    where the owner lock lives)."""
    proc = subprocess.Popen([sys.executable, "-c", _STANDIN, str(directory), prefix,
                             str(nbytes), str(count), str(pool_dir or "")],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line, "stand-in incarnation did not start"
    return proc, line[0], line[1:]


@contextmanager
def scratch_shm_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory in /dev/shm, emptied and removed afterwards."""
    d = Path("/dev/shm") / f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()

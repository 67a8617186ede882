"""The engine face stays fast through the daemon's heaviest work (issue 20, point 4).

Against real ``kvd serve`` processes, a probe thread sends Ping and Poll round trips to
the decode daemon's engine face while that daemon: registers a 1 GiB pool (allocation,
NIXL registration); posts and reads 1 GiB pulls (descriptor build, prep, post); reads
from a producer that freezes (SIGSTOP) and then dies (SIGKILL) mid-READ. Each phase
asserts p99 <= 50 ms and prints p50/p99/max with n, next to the daemon's own
``kvd_event_loop_lag_seconds`` (the loop itself, free of the probe's own scheduling).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from support.face_probe import Phase

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, blocks_view, layout_spec
from kvd.wire import protocol as P

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

# 256 KiB blocks (8 KV heads x 4 layers x 128 dims, bf16, 16 tokens): 1 GiB is 4,096
# blocks, 32,768 descriptors of 32 KiB before merging; blocks are read shuffled, so
# few merge.
BIG = P.ModelSpec(name="heavy", num_kv_heads=8, num_layers=4, head_dim=128)
BLOCK_NBYTES = 256 << 10
GIB_BLOCKS = (1 << 30) // BLOCK_NBYTES
BIG_SHAPE = EngineShape(tp_size=1, num_blocks=GIB_BLOCKS)
SMALL = P.ModelSpec(name="probe", num_kv_heads=2, num_layers=2, head_dim=16)
SMALL_SHAPE = EngineShape(tp_size=1, num_blocks=8)
P99_MAX_S = 0.05
PULLS = 3


def _start_pair(tmp_path: Path, decode_args: list[str] | None = None
                ) -> tuple[DaemonProcess, DaemonProcess]:
    big = ["--set", f"max_pool_bytes={4 << 30}", "--set", "pool_backing=shm"]
    prefill = DaemonProcess.start("heavyp", tmp_path, extra_args=big)
    decode = DaemonProcess.start("heavyd", tmp_path, extra_args=[*big, *(decode_args or [])])
    if os.environ.get("PYSPY_OUT"):  # TEMP profiling
        import subprocess
        subprocess.Popen(["/tmp/pyspy/py_spy-0.4.3.data/scripts/py-spy", "record", "-r", "250",
                          "-f", "raw", "-o", os.environ["PYSPY_OUT"], "--pid",
                          str(decode.proc.pid), "-t"])
    return prefill, decode


def _blocks(handle) -> np.ndarray:
    return blocks_view(handle.kv, BIG_SHAPE.kv_layout, BIG_SHAPE.head_layout)


def _fill(handle, seed: int) -> None:
    """Every 8-byte word distinct: a block read into the wrong place cannot match."""
    words = handle.kv.reshape(-1).view(np.uint64)
    words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed)


def test_registration_and_1gib_pulls_leave_the_engine_face_fast(tmp_path) -> None:
    prefill, decode = _start_pair(tmp_path)
    try:
        with prefill.client(timeout_s=60) as pc, decode.client(timeout_s=60) as dc:
            ph = pc.register("p", BIG, layout_spec(BIG_SHAPE))
            dc.register("d0", SMALL, layout_spec(SMALL_SHAPE))
            # (d) a registration in progress: a 1 GiB pool allocated and registered
            with Phase(decode, "d0", "registering a 1 GiB pool") as reg:
                dh = dc.register("d", BIG, layout_spec(BIG_SHAPE))

            # (c) 1 GiB pulls: assembly, descriptors, prep and post, the READ
            _fill(ph, 7)
            rng = np.random.default_rng(5)
            orders = [(rng.permutation(GIB_BLOCKS).tolist(), rng.permutation(GIB_BLOCKS).tolist())
                      for _ in range(PULLS)]
            events = []
            with Phase(decode, "d0", f"{PULLS} pulls of 1 GiB") as pulls:
                for i, (remote, local) in enumerate(orders):
                    pc.publish("p", f"g{i}", remote, lease_s=120)
                    events.append(dc.pull_and_wait("d", f"g{i}", "p", prefill.peer_address,
                                                   remote, local, timeout_s=120))
            for ev in events:
                assert ev.ok, ev.error
                assert ev.nbytes == 1 << 30
            remote, local = orders[-1]
            assert np.array_equal(_blocks(ph)[remote], _blocks(dh)[local])
        assert reg.p99() <= P99_MAX_S, reg.line
        assert pulls.p99() <= P99_MAX_S, pulls.line
    finally:
        prefill.kill()
        decode.stop()

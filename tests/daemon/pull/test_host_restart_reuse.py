"""A same-host pull is never ok with bytes its producer's engine reused after a restart.

Real ``kvd serve`` processes sharing /dev/shm, the host path (the consumer daemon C maps
the producer daemon V's pool files and copies). The order the fault needs, made exact:

* the decode engine's pull is issued before the prefill publishes, so C's Acquire waits
  at V; C is then frozen (SIGSTOP: a stall shorter than ``peer_liveness_timeout_s``,
  so nothing in C calls it a stall), and the prefill publishes: V's answer waits in C's
  socket;
* V is killed (-9); its successor V' (same pool prefix, already running) adopts the
  prefill's pool, and the prefill engine, as docs/engine-api.md lets it once a new
  incarnation answered, reuses its blocks: new bytes;
* C thaws: the Acquire's answer (from V, the incarnation it greeted) says the request is
  held, the copy runs from the mapped file, and it ends. Nothing failed on the way.

Without the owner check after the copy, C reported ok with the reused bytes in every
block. With it, the pull fails ``peer_lost`` and reports every block invalid.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

MODEL = ModelSpec(name="reuse", num_kv_heads=4, num_layers=8, head_dim=64)
SHAPE = EngineShape(tp_size=1, num_blocks=64)
IDS = [3, 5, 7, 9]
DST = [20, 21, 22, 23]


def _args(liveness_s: float) -> list[str]:
    return ["--set", "host_pulls=true", "--set", "pool_backing=shm",
            "--set", "heartbeat_interval_s=0.5",
            "--set", f"peer_liveness_timeout_s={liveness_s}",
            "--set", f"lease_s={max(30.0, liveness_s + 5)}"]


@pytest.mark.parametrize("liveness_s", [3.0, 20.0])
def test_a_host_pull_under_a_restart_and_reuse_is_never_ok_with_reused_bytes(
        tmp_path: Path, liveness_s: float) -> None:
    args = _args(liveness_s)
    v = DaemonProcess.start("hrv", tmp_path / "v", extra_args=args)
    c = DaemonProcess.start("hrc", tmp_path / "c", extra_args=args)
    successor: DaemonProcess | None = None
    stopped = False
    try:
        with v.client(ping_interval_s=0) as pc, c.client(ping_interval_s=0) as dc:
            pre = pc.register("pre", MODEL, layout_spec(SHAPE))
            dec = dc.register("dec", MODEL, layout_spec(SHAPE))
            g = global_kv(MODEL, len(IDS) * 16)
            write_shard(pre.kv, g, MODEL, SHAPE, 0, 0, IDS)
            pc.publish("pre", "warm", IDS)
            dc.pull("dec", "warm", "pre", v.peer_address, IDS, DST, num_tokens=len(IDS) * 16)
            warm = dc.wait("dec", "warm", "done_recving", timeout_s=20)
            assert warm.ok, warm.error
            assert check_shard(dec.kv, g, MODEL, SHAPE, 0, 0, DST) == 0
            paths = [p.path for p in dc.status().finished_pulls if p.request_id == "warm"]
            assert paths == ["host"]
            dec.kv[:] = 0

            # The next incarnation, ready before V dies (a restart without its start-up
            # time: the order of events is what matters).
            successor = DaemonProcess.start("hrv", tmp_path / "v2", extra_args=args)
            dc.pull("dec", "r1", "pre", v.peer_address, IDS, DST, num_tokens=len(IDS) * 16)
            time.sleep(0.2)  # C's Acquire is at V, waiting for the publish
            os.kill(c.proc.pid, signal.SIGSTOP)
            stopped, t_stop = True, time.monotonic()
            pc.publish("pre", "r1", IDS)  # V answers C's Acquire: the answer waits in C
            time.sleep(0.1)
            os.kill(v.proc.pid, signal.SIGKILL)
            v.proc.wait(10)
            with successor.client(ping_interval_s=0) as pc2:
                again = pc.adopt_rank(pre, via=pc2)
                assert again.instance_id != pre.instance_id
                reused = global_kv(MODEL, len(IDS) * 16, seed=99)
                write_shard(again.kv, reused, MODEL, SHAPE, 0, 0, IDS)  # the engine reuses
                held_s = time.monotonic() - t_stop
                assert held_s < liveness_s - 0.5, f"C was frozen {held_s:.1f}s: too long"
                os.kill(c.proc.pid, signal.SIGCONT)
                stopped = False
                recv = dc.wait("dec", "r1", "done_recving", timeout_s=30)
                pc2.deregister(again)
            if recv.ok:  # only if every byte is the request's own
                assert check_shard(dec.kv, g, MODEL, SHAPE, 0, 0, DST) == 0, \
                    "reported ok with bytes the producer's engine wrote after the restart"
            assert not recv.ok, "the copy read after the restart, yet was reported ok"
            assert recv.error.startswith("peer_lost") and "died or restarted" in recv.error
            assert sorted(recv.invalid_block_ids) == DST
    finally:
        if stopped:
            os.kill(c.proc.pid, signal.SIGCONT)
        for d in (c, v, successor):
            if d is not None:
                d.stop()
        for name in kvd_segments("kvd-hrv"):
            (SHM_DIR / name).unlink(missing_ok=True)

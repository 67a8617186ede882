"""Overload: thousands of pulls at once against a bounded queue.

Past max_inflight_pulls the daemon answers "busy" at once; everything it
accepted completes; it answers status while loaded; its memory stays bounded.

The producer daemon is paused (SIGSTOP) during the storm, so that pulls stay in
flight whatever their speed: a 1-block pull now ends within about one Acquire
round trip, faster than a client issues the next one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvd.errors import BusyError
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

MODEL = ModelSpec(name="load", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, num_blocks=64)
PULLS = 2000
BOUND = 64


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_thousands_of_pulls_are_bounded(tmp_path):
    prefill = DaemonProcess.start("ovp", tmp_path, extra_args=["--set", "drain_timeout_s=1"])
    decode = DaemonProcess.start("ovd", tmp_path,
                                 extra_args=["--set", f"max_inflight_pulls={BOUND}",
                                             "--set", "handshake_timeout_s=60"])
    g = global_kv(MODEL, 16)
    try:
        with prefill.client() as pc, decode.client() as dc, decode.client() as probe:
            pr = pc.register("p", MODEL, layout_spec(SHAPE))
            dr = dc.register("d", MODEL, layout_spec(SHAPE))
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [5])
            for i in range(PULLS):
                pc.publish("p", f"r{i}", [5], lease_s=120)
            # Warm the handshake so the storm measures queueing, not connection setup.
            dc.pull("d", "r0", "p", prefill.peer_address, [5], [9])
            assert dc.wait("d", "r0", "done_recving", timeout_s=20).ok
            rss_before = _rss_kib(decode.proc.pid)

            accepted, busy = [], 0
            t0 = time.perf_counter()
            os.kill(prefill.proc.pid, signal.SIGSTOP)  # every accepted pull waits for it
            try:
                for i in range(1, PULLS):
                    try:
                        dc.pull("d", f"r{i}", "p", prefill.peer_address, [5], [9])
                        accepted.append(f"r{i}")
                    except BusyError:
                        busy += 1
                    if i % 500 == 0:  # the daemon stays responsive while loaded
                        t = time.perf_counter()
                        probe.status()
                        assert time.perf_counter() - t < 2.0, "status took over 2 s under load"
            finally:
                os.kill(prefill.proc.pid, signal.SIGCONT)
            storm_s = time.perf_counter() - t0
            assert busy > 0, f"the bound was never reached ({len(accepted)} accepted)"
            assert decode.metric("kvd_busy_rejections_total") == busy  # counted once each
            for rid in accepted:
                ev = dc.wait("d", rid, "done_recving", timeout_s=60)
                assert ev.ok, ev.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [9]) == 0
            grown_kib = _rss_kib(decode.proc.pid) - rss_before
            assert grown_kib < 200 * 1024, f"decode daemon grew {grown_kib} KiB"
            assert not probe.status().pulls
            print(f"\noverload: {PULLS - 1} pulls in {storm_s:.2f}s, {len(accepted)} accepted, "
                  f"{busy} busy, RSS +{grown_kib} KiB")
    finally:
        prefill.stop()
        decode.stop()

"""Graceful drain: SIGTERM refuses new work, serves what is held, then exits 0."""

from __future__ import annotations

import signal
import time

import pytest

from kvd.errors import DrainingError
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="drain", num_kv_heads=2, num_layers=4, head_dim=32)
SHAPE = EngineShape(tp_size=1, num_blocks=32)


def test_sigterm_serves_held_blocks_then_exits_zero(tmp_path):
    prefill = DaemonProcess.start("drp", tmp_path, extra_args=["--set", "drain_timeout_s=15"])
    decode = DaemonProcess.start("drd", tmp_path)
    g = global_kv(MODEL, 8 * 16)
    ids = list(range(8))
    try:
        with prefill.client() as pc, decode.client() as dc:
            pr = pc.register("p", MODEL, layout_spec(SHAPE))
            dr = dc.register("d", MODEL, layout_spec(SHAPE))
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, ids)
            pc.publish("p", "held", ids, lease_s=60)
            prefill.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while True:  # new work is refused once the drain starts
                try:
                    # Accepted before the signal landed: short lease so the drain is not held up.
                    pc.publish("p", f"late-{time.monotonic()}", ids, lease_s=1)
                except DrainingError:
                    break
                assert time.monotonic() < deadline, "publish never refused while draining"
                time.sleep(0.05)
            assert prefill.proc.poll() is None, "exited while a request was still held"
            t0 = time.monotonic()
            dc.pull("d", "held", "p", prefill.peer_address, ids, ids[::-1])
            ev = dc.wait("d", "held", "done_recving", timeout_s=20)
            assert ev.ok, ev.error
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, ids[::-1]) == 0
            # Held set now empty: the daemon finishes well before the drain timeout.
            assert prefill.proc.wait(10) == 0
            assert time.monotonic() - t0 < 10
    finally:
        prefill.stop()
        decode.stop()

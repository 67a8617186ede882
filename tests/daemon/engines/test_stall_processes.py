"""Stalls through real processes: a frozen daemon retires nobody; a frozen engine that
was retired comes back with its pool, without a restart; both frozen together retire
nobody. After each, P/D works: a pull of the engine's published blocks is byte-exact.

One ``kvd serve`` (engine_timeout_s=1), a prefill engine in a child process (SIGSTOP
freezes it; it pings every 0.1 s and, told "not registered", registers again naming its
pool in adopt_pool, as kvd's vLLM connector does), and a decode engine in the test.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support.cluster import start_daemon, stop_and_check_clean

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec
from kvd.wire.protocol import ModelSpec

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

FREEZE_S = 3.0  # three engine timeouts
IDS = [2, 4, 6]
DST = [10, 11, 12]

_ENGINE = textwrap.dedent("""
    import queue, sys, threading, time
    from kvd.client import KvdClient
    from kvd.errors import KvdError, NotFoundError
    from kvd.tools.sim import EngineShape, global_kv, layout_spec, write_shard
    from kvd.wire.protocol import ModelSpec
    MODEL = ModelSpec(name="stall", num_kv_heads=2, num_layers=4, head_dim=32)
    SHAPE = EngineShape(tp_size=1, num_blocks=16)
    IDS = [2, 4, 6]
    c = KvdClient(sys.argv[1], timeout_s=10, ping_interval_s=0)
    h = c.register("eng", MODEL, layout_spec(SHAPE))
    write_shard(h.kv, global_kv(MODEL, len(IDS) * 16), MODEL, SHAPE, 0, 0, IDS)
    print("registered", h.pool.handle.name, h.instance_id, flush=True)
    cmds = queue.Queue()
    threading.Thread(target=lambda: [cmds.put(x.split()) for x in sys.stdin],
                     daemon=True).start()
    while True:
        try:
            c.ping(h)
        except NotFoundError:
            h = c.adopt_rank(h)
            print("rejoined", h.pool.handle.name, h.instance_id, flush=True)
        except KvdError as exc:
            print("ping-failed", exc, flush=True)
        while not cmds.empty():
            cmd = cmds.get()
            c.publish("eng", cmd[1], IDS)
            print("published", cmd[1], flush=True)
        time.sleep(0.1)
""")
MODEL = ModelSpec(name="stall", num_kv_heads=2, num_layers=4, head_dim=32)
SHAPE = EngineShape(tp_size=1, num_blocks=16)


class EngineChild:
    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ENGINE, address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[list[str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.split())

    def expect(self, word: str, timeout_s: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line[0] == word:
                return line
            assert line[0] != "rejoined", f"the engine had to register again: {line}"

    def said(self, word: str) -> bool:
        found = False
        while not self.lines.empty():
            found |= self.lines.get()[0] == word
        return found

    def publish(self, request_id: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"publish {request_id}\n")
        self.proc.stdin.flush()
        self.expect("published")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _freeze(*pids: int) -> None:
    """SIGSTOP them together for FREEZE_S, then SIGCONT."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(FREEZE_S)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _pd_works(d: DaemonProcess, engine: EngineChild, dc, dec, rid: str) -> None:
    engine.publish(rid)
    dc.pull("dec", rid, "eng", d.peer_address, IDS, DST, num_tokens=len(IDS) * 16)
    recv = dc.wait("dec", rid, "done_recving", timeout_s=20)
    assert recv.ok, recv.error
    assert check_shard(dec.kv, global_kv(MODEL, len(IDS) * 16), MODEL, SHAPE, 0, 0, DST) == 0
    dec.kv[:] = 0


def test_stalls_never_take_pd_away(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "stl", ["--set", "engine_timeout_s=1",
                                       "--set", "pool_backing=shm"])
    engine = EngineChild(d.engine_address)
    try:
        _, pool, instance = engine.expect("registered")
        with d.client(ping_interval_s=0.2) as dc:
            dec = dc.register("dec", MODEL, layout_spec(SHAPE))
            _pd_works(d, engine, dc, dec, "before")

            _freeze(d.proc.pid)  # the daemon: its engines' silence is not theirs
            time.sleep(0.5)
            assert not engine.said("rejoined"), "a frozen daemon retired a live engine"
            _pd_works(d, engine, dc, dec, "daemon-frozen")

            _freeze(d.proc.pid, engine.proc.pid)  # the whole host paused
            time.sleep(0.5)
            assert not engine.said("rejoined"), "a host pause retired a live engine"
            _pd_works(d, engine, dc, dec, "host-paused")

            _freeze(engine.proc.pid)  # the engine alone: retired, then it comes back
            line = engine.expect("rejoined")
            assert line[1:] == [pool, instance], "not its own pool back from the same daemon"
            _pd_works(d, engine, dc, dec, "engine-frozen")
            assert "takes its pool" in d.log_path.read_text()
            dc.deregister(dec)
    finally:
        engine.kill()
        stop_and_check_clean(d)

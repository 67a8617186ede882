"""kvd.ops.trace: off by default, and one clock for every process when on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvd.ops.trace import Tracer, read_traces


def test_off_writes_nothing(tmp_path):
    t = Tracer(None)
    t.point("pull_sent", "r1")
    assert not t.on and not list(tmp_path.iterdir())


def test_points_of_several_processes_line_up_in_time(tmp_path):
    before_ns = time.monotonic_ns()
    Tracer(str(tmp_path)).point("pull_sent", "r1")
    code = ("from kvd.ops.trace import TRACE; TRACE.point('event_taken', 'r1', 0.004)")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "KVD_TRACE_DIR": str(tmp_path)})
    Tracer(str(tmp_path)).point("recv_reported", "r1")
    points = read_traces(str(tmp_path))
    assert [p[1] for p in points] == ["pull_sent", "event_taken", "recv_reported"]
    assert points[0][0] >= before_ns
    assert points[1][3] == 0.004
    assert len(list(tmp_path.glob("*.trace"))) == 2  # one file per process

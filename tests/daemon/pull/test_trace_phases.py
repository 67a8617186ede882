"""With KVD_TRACE_DIR set, a reported pull leaves its phases in the trace: each
transition as seconds after the daemon took it, in order, within the time the daemon
had it (what `kvd bench vllm --breakdown` shows of a first transfer against warm ones)."""

from __future__ import annotations

import pytest
from support.cluster import run_transfer, stop_and_check_clean, unique
from support.matrix_cases import CASES

from kvd.ops.trace import ENV, PHASE_POINT, read_traces
from kvd.tools.localcluster import DaemonProcess

pytestmark = pytest.mark.nixl


def test_a_traced_daemon_writes_each_pulls_phases(tmp_path) -> None:
    trace_dir = tmp_path / "trace"
    d = DaemonProcess.start(unique("ittrace"), tmp_path, env={ENV: str(trace_dir)})
    c = d.client()
    try:
        m, pshape, dshape, tokens, skip = CASES[next(iter(CASES))]
        res = run_transfer(d, d, c, c, m, pshape, dshape, tokens, skip_tokens=skip)
        assert res.recv.ok and res.mismatches == 0, res.recv.error
    finally:
        c.close()
        stop_and_check_clean(d)
    points = read_traces(str(trace_dir))
    (took,) = [p for p in points if p[1] == "daemon_pull"]
    rid = took[2]
    queued = next(p for p in points if p[1] == "daemon_event" and p[2] == rid)
    phases = [(p[1][len(PHASE_POINT):], p[3]) for p in points
              if p[1].startswith(PHASE_POINT) and p[2] == rid]
    names = [n for n, _ in phases]
    assert {"post", "finish", "released"} <= set(names), names
    assert names[-1] == "released"
    at_s = [v for _, v in phases]
    assert all(v is not None and v >= 0 for v in at_s)
    assert at_s == sorted(at_s), "phases in the order they happened"
    # all within the time from the daemon taking the pull to its event
    assert at_s[-1] <= (queued[0] - took[0]) / 1e9 + 1e-3
    posts = [p for p in points if p[1] == "daemon_post" and p[2] == rid]
    assert posts and all(p[3] is not None and p[3] >= 0 for p in posts)


def test_the_producer_daemon_traces_when_it_took_and_answered_the_acquire(tmp_path) -> None:
    trace_dir = tmp_path / "trace"
    env = {ENV: str(trace_dir)}
    prefill = DaemonProcess.start(unique("ittrp"), tmp_path, env=env)
    try:
        decode = DaemonProcess.start(unique("ittrd"), tmp_path, env=env)
    except BaseException:
        stop_and_check_clean(prefill)
        raise
    pc, dc = prefill.client(), decode.client()
    try:
        m, pshape, dshape, tokens, skip = CASES[next(iter(CASES))]
        res = run_transfer(prefill, decode, pc, dc, m, pshape, dshape, tokens,
                           skip_tokens=skip)
        assert res.recv.ok and res.mismatches == 0, res.recv.error
    finally:
        pc.close()
        dc.close()
        stop_and_check_clean(prefill)
        stop_and_check_clean(decode)
    points = read_traces(str(trace_dir))
    at = {name: [p[0] for p in points if p[1] == name]
          for name in ("daemon_pull", "daemon_acquire", "daemon_acquired", "daemon_event")}
    assert all(len(v) == 1 for v in at.values()), at
    assert (at["daemon_pull"][0] <= at["daemon_acquire"][0] <= at["daemon_acquired"][0]
            <= at["daemon_event"][0])

"""Shared-token authentication on both faces, and the refusal to expose unauthenticated binds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvd.client import KvdClient
from kvd.errors import AuthError
from kvd.tools.localcluster import DaemonProcess, free_port
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="auth", num_kv_heads=2, num_layers=2, head_dim=16)
SHAPE = EngineShape(tp_size=1, num_blocks=8)
TOKEN = "s3cret-token-0123456789"


@pytest.fixture()
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def test_engine_face_refuses_missing_or_wrong_token(tmp_path, token_file):
    d = DaemonProcess.start("auth1", tmp_path, extra_args=["--auth-token-file", str(token_file)],
                            token=TOKEN)
    try:
        for bad in ("", "wrong-token-wrong-token"):
            with KvdClient(d.engine_address, token=bad, ping_interval_s=0) as c, \
                    pytest.raises(AuthError):
                c.status()
        assert d.metric("kvd_auth_failures_total", face="engine") == 2
        with KvdClient(d.engine_address, token=TOKEN, ping_interval_s=0) as c:
            assert c.status().daemon_id
    finally:
        d.stop()


def test_peer_face_requires_the_same_token(tmp_path, token_file):
    other = tmp_path / "other"
    other.write_text("a-different-token-456789\n")
    prefill = DaemonProcess.start("authp", tmp_path,
                                  extra_args=["--auth-token-file", str(token_file)], token=TOKEN)
    good = DaemonProcess.start("authg", tmp_path,
                               extra_args=["--auth-token-file", str(token_file)], token=TOKEN)
    bad = DaemonProcess.start("authb", tmp_path, extra_args=["--auth-token-file", str(other)],
                              token="a-different-token-456789")
    g = global_kv(MODEL, 32)
    try:
        with KvdClient(prefill.engine_address, token=TOKEN) as pc:
            pr = pc.register("p", MODEL, layout_spec(SHAPE))
            write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, [0, 1])
            pc.publish("p", "r1", [0, 1], lease_s=30)
            with KvdClient(bad.engine_address, token="a-different-token-456789") as bc:
                bc.register("d", MODEL, layout_spec(SHAPE))
                bc.pull("d", "r1", "p", prefill.peer_address, [0, 1], [2, 3])
                ev = bc.wait("d", "r1", "done_recving", timeout_s=20)
                assert not ev.ok and "unauthorized" in ev.error
                assert ev.invalid_block_ids == [2, 3]
            assert prefill.metric("kvd_auth_failures_total", face="peer") >= 1
            with KvdClient(good.engine_address, token=TOKEN) as gc:
                dr = gc.register("d", MODEL, layout_spec(SHAPE))
                gc.pull("d", "r1", "p", prefill.peer_address, [0, 1], [2, 3])
                ev = gc.wait("d", "r1", "done_recving", timeout_s=20)
                assert ev.ok, ev.error
                assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, [2, 3]) == 0
    finally:
        for d in (prefill, good, bad):
            d.stop()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", "serve", "--metrics-port", "0", *args],
                          capture_output=True, text=True, timeout=20)


def test_off_loopback_bind_without_auth_is_refused():
    res = _serve("--peer-address", f"tcp://0.0.0.0:{free_port()}")
    assert res.returncode == 2
    assert "without authentication" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_short_token_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc")
    res = _serve("--auth-token-file", str(short))
    assert res.returncode == 2 and "at least 16" in res.stderr

"""CurveZMQ on the peer face, through real `kvd serve` processes on loopback.

Daemons get keypairs from `kvd keys` and allowlists of public keys; pulls go through a
recording TCP relay (tests/support/tcp_relay.py) where the test needs the wire bytes.
Each refusal case is checked from both sides: the client's clear error, the server's
counted metric (and log line).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.raw_zmq import dealer
from support.tcp_relay import TcpRelay, replay

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

MODEL = ModelSpec(name="curve", num_kv_heads=4, num_layers=4, head_dim=32)
SHAPE = EngineShape(tp_size=1, num_blocks=32)
TOKEN = "curve-test-token-0123456789abcdef"
REQUEST_PREFIX = "secret-request-id-"


def keys(tmp: Path, name: str) -> tuple[Path, Path]:
    out = subprocess.run([sys.executable, "-m", "kvd", "keys", str(tmp / "keys"), "--name",
                          name], capture_output=True, text=True, check=True)
    assert "secret-key" not in out.stdout
    return tmp / "keys" / f"{name}.key", tmp / "keys" / f"{name}.key_secret"


def allow(tmp: Path, dirname: str, *publics: Path) -> Path:
    d = tmp / dirname
    d.mkdir(exist_ok=True)
    for p in publics:
        shutil.copy(p, d / p.name)
    return d


def curve_args(secret: Path, allowlist: Path, *extra: str) -> list[str]:
    return ["--set", f"curve_secret_key_file={secret}", "--set", f"curve_allowlist={allowlist}",
            *extra]


def start(name: str, tmp: Path, args: list[str]) -> DaemonProcess:
    token_file = tmp / f"{name}.token"
    token_file.write_text(TOKEN)
    return DaemonProcess.start(name, tmp, ["--auth-token-file", str(token_file),
                                           "--set", "handshake_timeout_s=10", *args],
                               token=TOKEN)


def eventually(check, what: str, bound_s: float = 5.0) -> None:
    """Each side of a refused ZMTP handshake sees why, unless the other's reset came
    first: the refused side redials every 100 ms, so the server counts one soon."""
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address[len("tcp://"):].rpartition(":")
    return host, int(port)


def pull(prefill: DaemonProcess, decode: DaemonProcess, rid: str, address: str,
         seed_tokens: int = 4 * 16) -> tuple[object, float]:
    """Publish 4 blocks on ``prefill`` and pull them from ``address``; (event, seconds)."""
    g = global_kv(MODEL, seed_tokens)
    p_ids, d_ids = [3, 9, 4, 20], [30, 1, 17, 8]
    with prefill.client(timeout_s=30) as pc, decode.client(timeout_s=30) as dc:
        pr = pc.register("pe", MODEL, layout_spec(SHAPE))
        write_shard(pr.kv, g, MODEL, SHAPE, 0, 0, p_ids)
        dr = dc.register("de", MODEL, layout_spec(SHAPE))
        pc.publish("pe", rid, p_ids)
        t0 = time.monotonic()
        dc.pull("de", rid, "pe", address, p_ids, d_ids)
        ev = dc.wait("de", rid, "done_recving", timeout_s=30)
        took = time.monotonic() - t0
        if ev.ok:
            assert check_shard(dr.kv, g, MODEL, SHAPE, 0, 0, d_ids) == 0
        return ev, took


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict]:
    """Keypairs a (prefill), b (decode), x (a stranger); allowlists with a and b."""
    k = {n: keys(tmp_path, n) for n in ("a", "b", "x")}
    allowlist = allow(tmp_path, "allow", k["a"][0], k["b"][0])
    started: list[DaemonProcess] = []
    yield {"keys": k, "allow": allowlist, "tmp": tmp_path, "started": started}
    for d in started:
        d.stop()


def test_curve_pull_is_byte_exact_and_nothing_readable_crosses(fleet: dict) -> None:
    """With CURVE: byte-exact pull, and neither token, request id nor NIXL agent
    metadata in the recorded peer-face bytes. Without: all three are there."""
    tmp, k = fleet["tmp"], fleet["keys"]
    seen = {}
    for curve in (True, False):
        tag = "on" if curve else "off"
        args = (lambda n: curve_args(k[n][1], fleet["allow"])) if curve else (lambda n: [])
        a = start(f"a{tag}", tmp, args("a"))
        b = start(f"b{tag}", tmp, args("b"))
        fleet["started"] += [a, b]
        relay = TcpRelay(host_port(a.peer_address))
        try:
            ev, _ = pull(a, b, REQUEST_PREFIX + tag, relay.address)
            assert ev.ok, ev.error
            with b.client() as bc:
                agent = bc.status().peers[0].agent
            wire = relay.recorded()
        finally:
            relay.close()
        assert len(wire) > 1000, "the pull did not go through the relay"
        seen[curve] = {"token": TOKEN.encode() in wire,
                       "request id": (REQUEST_PREFIX + tag).encode() in wire,
                       "agent metadata": agent.encode() in wire and b"UCX" in wire}
        if curve:
            assert a.metric("kvd_curve_refusals_total") == 0
            assert b.metric("kvd_handshakes_total", outcome="ok") == 1
            assert b"CURVE" in wire[:64]  # the ZMTP greeting names the mechanism
    assert seen[True] == {"token": False, "request id": False, "agent metadata": False}, seen
    assert seen[False] == {"token": True, "request id": True, "agent metadata": True}, seen


def test_unknown_key_is_refused_with_a_clear_error_and_a_count(fleet: dict) -> None:
    tmp, k = fleet["tmp"], fleet["keys"]
    a = start("a", tmp, curve_args(k["a"][1], fleet["allow"]))
    # x knows a's key (its allowlist has it) but a does not know x's.
    x_allow = allow(tmp, "x-allow", k["a"][0], k["x"][0])
    x = start("x", tmp, curve_args(k["x"][1], x_allow))
    fleet["started"] += [a, x]
    ev, took = pull(a, x, "r-unknown", a.peer_address)
    assert not ev.ok
    assert "does not allow this side's public key" in ev.error, ev.error
    assert took < 5, f"refusal took {took:.1f}s (handshake_timeout_s is 10): a hang"
    eventually(lambda: a.metric("kvd_curve_refusals_total", face="peer",
                                reason="unknown_key") >= 1, "unknown key not counted")
    log = a.log_path.read_text()
    assert "not in the allowlist" in log
    secret = k["x"][1].read_text().split('secret-key = "')[1][:40]
    for d in (a, x):  # no secret key in any log
        assert secret not in d.log_path.read_text()
        assert k["a"][1].read_text().split('secret-key = "')[1][:40] not in d.log_path.read_text()


def test_plaintext_daemon_to_curve_daemon_is_a_clear_error_not_a_hang(fleet: dict) -> None:
    tmp, k = fleet["tmp"], fleet["keys"]
    a = start("a", tmp, curve_args(k["a"][1], fleet["allow"]))
    plain = start("plain", tmp, [])
    fleet["started"] += [a, plain]
    ev, took = pull(a, plain, "r-plain", a.peer_address)
    assert not ev.ok
    assert "requires CURVE" in ev.error, ev.error
    assert took < 5, f"refusal took {took:.1f}s (handshake_timeout_s is 10): a hang"
    # Not asserted: that `a` counted the plaintext daemon. Whichever side reads the
    # other's greeting first ends the connection, so `a` may never see a full plaintext
    # greeting (it failed 2 of 3 runs on a busy host); fresh plaintext clients until one
    # is counted: test_plaintext_engine_client_to_curve_engine_face_is_refused.
    # The other way round: a CURVE daemon refuses to talk to a plaintext one.
    b = start("b", tmp, curve_args(k["b"][1], allow(tmp, "b-allow", k["a"][0])))
    fleet["started"].append(b)
    ev, took = pull(plain, b, "r-plain2", plain.peer_address)
    assert not ev.ok and took < 5
    assert "does not speak CURVE" in ev.error, ev.error
    assert plain.metric("kvd_handshakes_total", outcome="ok") == 0


def test_plaintext_engine_client_to_curve_engine_face_is_refused(fleet: dict) -> None:
    """The engine face only runs CURVE off loopback, so here a raw ZMQ client stands
    in for a plaintext one on the peer face: no reply ever, and it is counted.

    The server counts a plaintext client when it reads the client's greeting. A client
    that reads the server's greeting first sees the mismatch, hangs up and never dials
    again (libzmq ends a connection on a ZMTP protocol error for good), and its hang-up
    can reset the connection before the server read anything: about one client in ten
    on this host. So fresh clients dial until one is counted; one client alone failed
    this test 1 run in 6."""
    from kvd.wire import protocol as P

    tmp, k = fleet["tmp"], fleet["keys"]
    a = start("a", tmp, curve_args(k["a"][1], fleet["allow"]))
    fleet["started"].append(a)
    hello = P.encode(P.Heartbeat(producer_engine_id="pe", request_ids=["x"]), 1, TOKEN)
    deadline, clients = time.monotonic() + 10.0, 0
    while a.metric("kvd_curve_refusals_total", face="peer", reason="plaintext") < 1:
        assert time.monotonic() < deadline, f"none of {clients} plaintext clients counted"
        with dealer(a.peer_address) as s:
            s.send_multipart(hello)
            assert not s.poll(1500 if clients == 0 else 300), \
                "a CURVE peer face answered a plaintext client"
        clients += 1


@pytest.mark.parametrize("trigger", ["file-change", "sighup"])
def test_allowlist_reload_closes_a_removed_keys_connections(fleet: dict, trigger: str) -> None:
    tmp, k = fleet["tmp"], fleet["keys"]
    interval = "0.2" if trigger == "file-change" else "600"
    a = start("a", tmp, curve_args(k["a"][1], fleet["allow"], "--set",
                                   f"curve_reload_interval_s={interval}"))
    b = start("b", tmp, curve_args(k["b"][1], fleet["allow"]))
    fleet["started"] += [a, b]
    ev, _ = pull(a, b, "r-before", a.peer_address)
    assert ev.ok, ev.error
    lost = f"peer {a.peer_address} disconnected"
    assert lost not in b.log_path.read_text()
    (fleet["allow"] / "b.key").unlink()
    t0 = time.monotonic()
    if trigger == "sighup":
        os.kill(a.proc.pid, signal.SIGHUP)
    bound_s = 3.0
    while time.monotonic() - t0 < bound_s:
        if (a.metric("kvd_curve_refusals_total", face="peer", reason="revoked") >= 1
                and lost in b.log_path.read_text()):
            break
        time.sleep(0.05)
    closed_s = time.monotonic() - t0
    assert closed_s < bound_s, "the removed key's connection was not closed in time"
    assert a.metric("kvd_curve_allowlist_keys", face="peer") == 1
    ev, took = pull(a, b, "r-after", a.peer_address)
    assert not ev.ok and "does not allow this side's public key" in ev.error, ev.error
    assert took < 5
    print(f"{trigger}: connection closed {closed_s * 1000:.0f} ms after the key was removed")


def test_replayed_handshake_is_refused(fleet: dict) -> None:
    """A client stream captured during a pull (greeting, HELLO, INITIATE, requests),
    sent again on a new connection: the server's new cookie does not open the old
    INITIATE, so nothing is answered and the connection is closed."""
    tmp, k = fleet["tmp"], fleet["keys"]
    a = start("a", tmp, curve_args(k["a"][1], fleet["allow"]))
    b = start("b", tmp, curve_args(k["b"][1], fleet["allow"]))
    fleet["started"] += [a, b]
    relay = TcpRelay(host_port(a.peer_address))
    try:
        ev, _ = pull(a, b, "r-replay", relay.address)
        assert ev.ok, ev.error
        captured = bytes(relay.conns[0].up)
        answered = len(relay.conns[0].down)
    finally:
        relay.close()
    before = a.metric("kvd_curve_refusals_total", face="peer", reason="handshake")
    got, closed = replay(host_port(a.peer_address), captured)
    # Greeting (64 bytes) and a WELCOME (170) at most: no READY, no reply.
    assert closed, "the server kept a replayed handshake's connection open"
    assert len(got) < 64 + 200 < answered, (len(got), answered)
    deadline = time.monotonic() + 3
    while a.metric("kvd_curve_refusals_total", face="peer", reason="handshake") <= before:
        assert time.monotonic() < deadline, "the replay was not counted"
        time.sleep(0.05)
    # The daemon still serves its real peer.
    ev, _ = pull(a, b, "r-after-replay", a.peer_address)
    assert ev.ok, ev.error


def test_curve_start_refusals(tmp_path: Path) -> None:
    """A world-readable secret key, a missing allowlist: one clear error at start."""
    pub, sec = keys(tmp_path, "a")
    assert oct(sec.stat().st_mode & 0o777) == "0o600"
    assert oct(pub.stat().st_mode & 0o777) == "0o644"
    os.chmod(sec, 0o644)
    out = subprocess.run([sys.executable, "-m", "kvd", "serve", "--set",
                          f"curve_secret_key_file={sec}", "--set", f"curve_allowlist={pub}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "open to other users" in out.stderr, out.stderr
    assert sec.read_text().split('secret-key = "')[1][:40] not in out.stderr
    os.chmod(sec, 0o600)
    out = subprocess.run([sys.executable, "-m", "kvd", "serve", "--set",
                          f"curve_secret_key_file={sec}"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "curve_allowlist: required" in out.stderr, out.stderr
    # Off loopback, CURVE on the peer face alone still leaves the engine face open.
    out = subprocess.run([sys.executable, "-m", "kvd", "serve", "--engine-address",
                          "tcp://198.18.0.1:7100", "--peer-address", "tcp://198.18.0.1:7101",
                          "--set", f"curve_secret_key_file={sec}", "--set",
                          f"curve_allowlist={pub}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "refusing to bind ['tcp://198.18.0.1:7100']" in out.stderr


def test_keys_refuses_to_overwrite(tmp_path: Path) -> None:
    keys(tmp_path, "a")
    out = subprocess.run([sys.executable, "-m", "kvd", "keys", str(tmp_path / "keys"),
                          "--name", "a"], capture_output=True, text=True)
    assert out.returncode == 2 and "exists" in out.stderr


def test_keypair_rotation_without_restart(fleet: dict) -> None:
    """The documented procedure (docs/operations.md "CURVE keys"): allowlist the new
    public key, swap the keypair file and SIGHUP, drop the old public key. Pulls work
    at every step, the daemon's pid never changes."""
    tmp, k = fleet["tmp"], fleet["keys"]
    a = start("a", tmp, curve_args(k["a"][1], fleet["allow"]))
    b = start("b", tmp, curve_args(k["b"][1], fleet["allow"], "--set",
                                   "curve_reload_interval_s=0.2"))
    fleet["started"] += [a, b]
    pid = a.proc.pid
    ev, _ = pull(a, b, "r-rot-0", a.peer_address)
    assert ev.ok, ev.error
    new_pub, new_sec = keys(tmp, "a2")
    shutil.copy(new_pub, fleet["allow"] / new_pub.name)  # 1: both keys allowed
    time.sleep(0.5)
    staged = k["a"][1].with_suffix(".new")
    shutil.copy(new_sec, staged)
    os.chmod(staged, 0o600)
    os.replace(staged, k["a"][1])  # 2: the new keypair, atomically, then SIGHUP
    os.kill(a.proc.pid, signal.SIGHUP)
    eventually(lambda: "keypair rotated" in a.log_path.read_text(), "no rotation logged")
    ev, _ = pull(a, b, "r-rot-1", a.peer_address)
    assert ev.ok, ev.error
    (fleet["allow"] / "a.key").unlink()  # 3: the old key out of every allowlist
    time.sleep(0.5)
    ev, _ = pull(a, b, "r-rot-2", a.peer_address)
    assert ev.ok, ev.error
    assert a.proc.pid == pid and a.proc.poll() is None
    assert new_sec.read_text().split('secret-key = "')[1][:40] not in a.log_path.read_text()

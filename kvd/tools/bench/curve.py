"""``kvd bench curve``: what CurveZMQ on the peer face costs, CURVE on against off.

Two pairs of ``kvd serve`` processes run side by side (prefill and decode each): one
plaintext, one with keypairs and an allowlist. The measurements alternate between the
pairs, pull by pull (the order swapped every other time), so background load falls on
both alike:

* a ``nbytes`` pull (random blocks, Llama-3-8B-like geometry; checked byte for byte
  once per pair) timed at the client from publish to done_recving: median GB/s;
* 1-block pulls: p50 and p99 of pull to done_recving at the client;
* handshake time: the ZMTP connection handshake to the producer's peer face (NULL
  against CURVE: connect to the handshake-succeeded event, from this process, median
  of ``handshakes`` fresh connections), and kvd's own Hello handshake (the decode
  daemon's ``kvd_handshake_duration_seconds``, its first pull).

CURVE costs per message (a box per frame, both ways) and once per connection (the
handshake: four messages and five Curve25519 operations); NIXL's READs do not touch
the control plane, so the large pull is expected to move within the noise.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvd.tools.bench.e2e import check_pulled_blocks, timed_pull
from kvd.tools.bench.geometry import DEFAULT_SHM_DIR, Geometry, MiB, fmt_gbps, fmt_ms
from kvd.tools.bench.raw import fill_test_pattern
from kvd.tools.sim import layout_spec
from kvd.wire import curve as C

MODES = ("off", "on")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def zmtp_handshake_s(address: str, keys: C.KeyPair | None, server_key: bytes | None) -> float:
    """Seconds from connect to ZMQ's handshake-succeeded event on a fresh connection."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None and server_key is not None:
        C.client_socket(s, keys, server_key)
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        t0 = time.perf_counter()
        s.connect(address)
        if not mon.poll(5000):
            raise RuntimeError(f"no handshake with {address} within 5 s")
        from zmq.utils.monitor import recv_monitor_message

        ev = recv_monitor_message(mon)
        took = time.perf_counter() - t0
        if ev["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            raise RuntimeError(f"handshake with {address} failed: {ev}")
        return took
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


def bench_curve(nbytes_mib: int = 512, repeats: int = 5, latency_pulls: int = 200,
                handshakes: int = 20, shm_dir: str = DEFAULT_SHM_DIR,
                seed: int = 7) -> dict[str, Any]:
    from kvd.tools.localcluster import DaemonProcess

    geom = Geometry()
    blocks = max(1, nbytes_mib * MiB // geom.block_nbytes)
    pool_blocks = blocks + max(1, blocks // 4)
    rng = random.Random(seed)
    p_ids = rng.sample(range(pool_blocks), blocks)
    d_ids = rng.sample(range(pool_blocks), blocks)
    logs = Path(tempfile.mkdtemp(prefix="kvd-bench-curve-"))
    keydir, allow = logs / "keys", logs / "allow"
    allow.mkdir(parents=True)
    for name in ("prefill", "decode"):
        pub, _ = C.write_keypair(keydir, name)
        (allow / pub.name).write_text(pub.read_text())
    common = ["--set", f"shm_dir={shm_dir}", "--set", "host_pulls=false"]  # NIXL, as two nodes
    daemons: dict[str, tuple[Any, Any]] = {}
    clients: dict[str, tuple[Any, Any]] = {}
    out: dict[str, Any] = {"nbytes": blocks * geom.block_nbytes, "repeats": repeats,
                           "latency_pulls": latency_pulls, "logs": str(logs)}
    try:
        for mode in MODES:
            def args(name: str, mode: str = mode) -> list[str]:
                if mode == "off":
                    return common
                return [*common, "--set", f"curve_secret_key_file={keydir / name}.key_secret",
                        "--set", f"curve_allowlist={allow}"]

            daemons[mode] = (DaemonProcess.start(f"bc-{mode}-p", logs, args("prefill")),
                             DaemonProcess.start(f"bc-{mode}-d", logs, args("decode")))
            clients[mode] = (daemons[mode][0].client(timeout_s=60),
                             daemons[mode][1].client(timeout_s=60))
        model = geom.model()
        shape = geom.shape(1, pool_blocks)
        kvs: dict[str, tuple[Any, Any]] = {}
        for mode in MODES:
            pc, dc = clients[mode]
            pr = pc.register("prefill", model, layout_spec(shape))
            fill_test_pattern(pr.kv.reshape(-1).view(np.uint8), start=1 << 40)
            dr = dc.register("decode", model, layout_spec(shape))
            kvs[mode] = (pr.kv, dr.kv)

        def pull(mode: str, rid: str, src: list[int], dst: list[int]) -> tuple[float, Any]:
            pc, dc = clients[mode]
            total, _, ev = timed_pull(pc, dc, daemons[mode][0].peer_address, "decode", rid,
                                      src, dst)
            return total, ev

        # Warm-up (handshake, NIXL connection, page faults) and the byte-exact check.
        verified = {}
        for mode in MODES:
            pull(mode, f"{mode}-warm", p_ids, d_ids)
            verified[mode] = check_pulled_blocks(kvs[mode][0], [kvs[mode][1]], geom, p_ids,
                                                 d_ids)
        out["verified"] = verified
        out["kvd_handshake_ms"] = {
            mode: fmt_ms(daemons[mode][1].metric("kvd_handshake_duration_seconds_sum")
                         / max(1.0, daemons[mode][1].metric(
                             "kvd_handshake_duration_seconds_count")))
            for mode in MODES}
        big: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(repeats):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                big[mode].append(pull(mode, f"{mode}-big-{i}", p_ids, d_ids)[0])
        lat: dict[str, list[float]] = {m: [] for m in MODES}
        one_p, one_d = p_ids[:1], d_ids[:1]
        for i in range(max(10, latency_pulls // 10)):
            for mode in MODES:
                pull(mode, f"{mode}-lwarm-{i}", one_p, one_d)
        for i in range(latency_pulls):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                pc, dc = clients[mode]
                _, pull_s, _ = timed_pull(pc, dc, daemons[mode][0].peer_address, "decode",
                                          f"{mode}-lat-{i}", one_p, one_d)
                lat[mode].append(pull_s)
        keys = C.load_keypair(keydir / "decode.key_secret")
        server = C.load_public_key(keydir / "prefill.key", "prefill")
        hs: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(handshakes):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                hs[mode].append(zmtp_handshake_s(
                    daemons[mode][0].peer_address, keys if mode == "on" else None,
                    server if mode == "on" else None))
        for mode in MODES:
            out[mode] = {
                "gbps": fmt_gbps(out["nbytes"], statistics.median(big[mode])),
                "big_ms": [fmt_ms(x) for x in big[mode]],
                "one_block_p50_ms": fmt_ms(_pct(lat[mode], 50)),
                "one_block_p99_ms": fmt_ms(_pct(lat[mode], 99)),
                "zmtp_handshake_ms": fmt_ms(statistics.median(hs[mode])),
                "kvd_handshake_ms": out["kvd_handshake_ms"][mode],
            }
        out["ratio_gbps_on_off"] = round(statistics.median(big["off"])
                                         / statistics.median(big["on"]), 4)
        out["ratio_p50_on_off"] = round(_pct(lat["on"], 50) / _pct(lat["off"], 50), 4)
        out["refusals_on"] = sum(daemons["on"][i].metric("kvd_curve_refusals_total")
                                 for i in range(2))
        return out
    finally:
        for pair in clients.values():
            for c in pair:
                c.close()
        for pair in daemons.values():
            for d in pair:
                d.stop()


def render_curve(r: dict[str, Any]) -> str:
    rows = [f"kvd bench curve: {r['nbytes'] / MiB:.0f} MiB pulls x{r['repeats']}, "
            f"{r['latency_pulls']} 1-block pulls per mode, alternating",
            f"{'':28}{'CURVE off':>12}{'CURVE on':>12}"]
    for key, label in (("gbps", f"{r['nbytes'] / MiB:.0f} MiB pull GB/s (median)"),
                       ("one_block_p50_ms", "1-block pull p50 ms"),
                       ("one_block_p99_ms", "1-block pull p99 ms"),
                       ("zmtp_handshake_ms", "ZMTP handshake ms (median)"),
                       ("kvd_handshake_ms", "kvd Hello handshake ms")):
        rows.append(f"{label:28}{r['off'][key]!s:>12}{r['on'][key]!s:>12}")
    rows.append(f"throughput on/off: {r['ratio_gbps_on_off']:.3f}; "
                f"1-block p50 on/off: {r['ratio_p50_on_off']:.3f}; "
                f"verified: {r['verified']}; refusals with CURVE: {r['refusals_on']:.0f}")
    return "\n".join(rows)

"""What crosses a simulated link: capture frames on a switch port, read TCP streams back.

``python wire_tools.py capture IFACE FILE`` (run inside the switch's namespace) records
every frame of IFACE with a raw AF_PACKET socket until SIGTERM, as 4-byte length +
frame; it prints ``ready`` once bound. ``python wire_tools.py replay HOST PORT FILE``
(run inside a node) sends FILE's bytes on a fresh TCP connection and prints what came
back as JSON. `streams` reassembles the TCP payloads of a capture by connection.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import sys
from collections import defaultdict
from pathlib import Path

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800

Flow = tuple[str, int, str, int]  # (src ip, src port, dst ip, dst port)


def capture(iface: str, out: str) -> None:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((iface, 0))
    s.settimeout(0.2)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with open(out, "wb") as f:
        print("ready", flush=True)
        while not stop:
            try:
                frame = s.recv(65536)
            except TimeoutError:
                continue
            except InterruptedError:
                continue
            f.write(struct.pack("!I", len(frame)) + frame)
        f.flush()


def frames(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    out, i = [], 0
    while i + 4 <= len(data):
        (n,) = struct.unpack_from("!I", data, i)
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return out


def streams(path: str | Path) -> dict[Flow, bytes]:
    """Every TCP connection's payload per direction, in sequence order (each frame is
    seen once per direction on a switch port; retransmissions are dropped)."""
    segs: dict[Flow, dict[int, bytes]] = defaultdict(dict)
    for fr in frames(path):
        if len(fr) < 34 or struct.unpack_from("!H", fr, 12)[0] != ETH_P_IP:
            continue
        ip = fr[14:]
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != socket.IPPROTO_TCP:
            continue
        total = struct.unpack_from("!H", ip, 2)[0]
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack_from("!HHI", tcp, 0)
        off = (tcp[12] >> 4) * 4
        payload = tcp[off:]
        if payload:
            segs[(src, sport, dst, dport)].setdefault(seq, payload)
    out: dict[Flow, bytes] = {}
    for flow, by_seq in segs.items():
        buf, end = bytearray(), None
        for seq in sorted(by_seq):  # (no wrap-around in a test's few MiB)
            p = by_seq[seq]
            if end is not None and seq < end:
                p = p[end - seq:]
            buf += p
            end = max(end or 0, seq + len(by_seq[seq]))
        out[flow] = bytes(buf)
    return out


def replay(host: str, port: int, path: str, wait_s: float = 2.0) -> dict[str, object]:
    stream = Path(path).read_bytes()
    got = bytearray()
    closed = False
    with socket.create_connection((host, port), timeout=wait_s) as s:
        try:
            s.sendall(stream)
        except OSError:
            pass
        s.settimeout(wait_s)
        while True:
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            except OSError:
                closed = True
                break
            if not data:
                closed = True
                break
            got += data
    return {"received": len(got), "closed": closed, "head": got[:16].hex()}


if __name__ == "__main__":
    if sys.argv[1] == "capture":
        capture(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "replay":
        print(json.dumps(replay(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")

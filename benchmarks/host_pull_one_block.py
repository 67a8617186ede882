"""One-block same-host pull latency, two code trees side by side (a benchmark, not a test).

Two ``kvd serve`` on this host with ``host_pulls=true`` (the consumer maps the
producer's pool files and copies), one 1-block request at a time: publish (with its
receipt), pull, wait for ``done_recving``. Reports per tree and round the p50 of the
engine's wall time and of the daemon's own ``duration_s``. Trees alternate round by
round so that background load hits both alike:

    python benchmarks/host_pull_one_block.py --tree before=/path/a --tree after=/path/b

A tree is a kvd checkout; its daemons run with ``PYTHONPATH`` set to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

MODEL = ModelSpec(name="hp1", num_kv_heads=8, num_layers=32, head_dim=128)  # 2 MiB/block
SHAPE = EngineShape(tp_size=1, num_blocks=64)
ARGS = ["--set", "host_pulls=true", "--set", "pool_backing=shm"]


def one_round(tree: str, pulls: int, tag: str) -> dict[str, float]:
    env = {"PYTHONPATH": tree}
    with tempfile.TemporaryDirectory() as tmp:
        v = DaemonProcess.start(f"hpv{tag}", Path(tmp), extra_args=ARGS, env=env)
        c = DaemonProcess.start(f"hpc{tag}", Path(tmp), extra_args=ARGS, env=env)
        try:
            with v.client(ping_interval_s=0) as pc, c.client(ping_interval_s=0) as dc:
                pc.register("pre", MODEL, layout_spec(SHAPE))
                dc.register("dec", MODEL, layout_spec(SHAPE))
                wall, daemon, paths = [], [], set()
                for i in range(pulls + 20):  # 20 warm-ups
                    rid = f"r{i}"
                    receipt = pc.publish("pre", rid, [i % 32])
                    t0 = time.perf_counter()
                    dc.pull("dec", rid, "pre", v.peer_address, [i % 32], [32 + i % 32],
                            num_tokens=16, publish_receipt=receipt)
                    ev = dc.wait("dec", rid, "done_recving", timeout_s=20)
                    t1 = time.perf_counter()
                    assert ev.ok, ev.error
                    pc.wait("pre", rid, "done_sending", timeout_s=20)
                    if i >= 20:
                        wall.append(t1 - t0)
                        daemon.append(ev.duration_s)
                paths = {p.path for p in dc.status().finished_pulls}
                assert paths == {"host"}, paths
        finally:
            c.stop()
            v.stop()
    return {"wall_p50_us": statistics.median(wall) * 1e6,
            "daemon_p50_us": statistics.median(daemon) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pulls", type=int, default=300)
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    # `python -m kvd` puts the working directory first on the daemons' sys.path: run
    # from a neutral one, or a checkout there would shadow every tree's PYTHONPATH
    os.chdir(tempfile.gettempdir())
    out: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for k, (name, path) in enumerate(trees):
            res = one_round(path, args.pulls, f"{r}{k}")
            out[name].append(res)
            print(f"round {r + 1} {name}: wall p50 {res['wall_p50_us']:.0f} us, "
                  f"daemon p50 {res['daemon_p50_us']:.0f} us", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The first hand-over of a pair against warm ones, at the daemon level (a benchmark, not a test).

Per layout, fresh ``kvd serve`` daemons each time (no vLLM): a producer and a consumer
engine of `kvd bench vllm`'s tiny Llama (4 layers, 2 KV heads of 64, float32, 32-token
blocks: 128 KiB per block) register as the connector does, the consumer sends its
`WarmUp` naming the producer, an idle gap follows (an engine loading, ``--gap-s``),
then the first hand-over of 25 random blocks (3.2 MB) to random consumer blocks, then
``--warm`` more of fresh random blocks. Each is sent as the connector sends it: the
publish with its receipt, the pull without waiting for its reply (`NoWaitClient`).
Layouts:

* ``1d``: one daemon, both engines (local copies);
* ``2d``: two daemons on this host, copies through the mapped pool files (host_pulls);
* ``2d-nixl``: two daemons, NIXL READs (host_pulls off).

Printed per layout and tree: the first pull's time over the warm ones' median, both as
the daemon's own ``duration_s`` and as the engine's wall time (pull sent -> event), per
run and their median over ``--runs``; the same for one more pull after the same idle
gap (the control: what idling alone costs a warm pair: cold caches, sleeping threads);
and the consumer daemon's page faults (minor, from /proc) during the first pull and
during a warm one. Trees alternate run by run so
that background load hits both alike:

    python benchmarks/first_transfer.py --tree before=/tmp/kvd-main --tree after=$PWD

A tree is a kvd checkout; its daemons run with ``PYTHONPATH`` set to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import zlib
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from kvd.client.core import Messages
from kvd.client.nowait import NoWaitClient
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

MODEL = ModelSpec(name="tiny", num_kv_heads=2, num_layers=4, head_dim=64, dtype="float32")
SHAPE = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=512)  # 64 MiB pools
BLOCKS = 25
LAYOUTS = {"1d": None, "2d": ["--set", "host_pulls=true"],
           "2d-nixl": ["--set", "host_pulls=false"]}


def _minflt(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7])  # minflt (majflt is fields[9]: none on tmpfs)


def one_run(tree: str, layout: str, warm: int, gap_s: float, tag: str, log_dir: str,
            shape: EngineShape = SHAPE) -> dict[str, float]:
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    env = {"PYTHONPATH": tree}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        def daemon(name: str, args: list[str] | None) -> DaemonProcess:
            d = DaemonProcess.start(f"ft{tag}{name}", Path(log_dir or tmp), args, env=env)
            stack.callback(d.stop)
            return d

        args = LAYOUTS[layout]
        dd = daemon("d", args)
        pd = dd if args is None else daemon("p", args)
        pc = stack.enter_context(pd.client(ping_interval_s=0, timeout_s=30))
        dc = pc if pd is dd else stack.enter_context(dd.client(ping_interval_s=0, timeout_s=30))
        nowait = NoWaitClient(dd.engine_address)
        stack.callback(nowait.close)
        p = pc.register("pre", MODEL, layout_spec(shape))
        dc.register("dec", MODEL, layout_spec(shape))
        p.kv.reshape(-1).view(np.uint8)[:] = rng.integers(0, 255, p.kv.nbytes, np.uint8)
        dc.warm_up("dec", [("pre", pd.peer_address)])  # as the connector, at start-up
        time.sleep(gap_s)  # the engine loads, compiles, profiles...

        def ids() -> list[int]:
            return sorted(rng.choice(shape.num_blocks, BLOCKS, replace=False).tolist())

        def handover(rid: str) -> tuple[float, float, int]:
            src = ids()
            receipt = pc.publish("pre", rid, src)
            msg = Messages.pull("dec", rid, "pre", pd.peer_address, src, ids(), rid,
                                num_tokens=-1, publish_receipt=receipt)
            f0 = _minflt(dd.proc.pid)
            t0 = time.perf_counter()
            assert nowait.send(msg, rid, time.monotonic())
            ev = dc.wait("dec", rid, "done_recving", timeout_s=30)
            t1 = time.perf_counter()
            faults = _minflt(dd.proc.pid) - f0
            assert ev.ok, ev.error
            pc.wait("pre", rid, "done_sending", timeout_s=30)
            return ev.duration_s, t1 - t0, faults

        first = handover("first")
        warms = [handover(f"w{i}") for i in range(warm)]
        time.sleep(gap_s)  # the control: a warm pair, after the same idle gap
        idle = handover("idle")
        paths = {f.path for f in dc.status().finished_pulls}
    d50 = statistics.median(w[0] for w in warms)
    w50 = statistics.median(w[1] for w in warms)
    return {"first_daemon_us": first[0] * 1e6, "warm_daemon_p50_us": d50 * 1e6,
            "first_x_warm_daemon": first[0] / d50,
            "first_wall_us": first[1] * 1e6, "warm_wall_p50_us": w50 * 1e6,
            "first_x_warm_wall": first[1] / w50,
            "idle_x_warm_daemon": idle[0] / d50, "idle_x_warm_wall": idle[1] / w50,
            "first_minflt": first[2], "warm_minflt_p50": statistics.median(w[2] for w in warms),
            "path": "/".join(sorted(paths))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--layout", action="append", choices=list(LAYOUTS),
                    help="default: all three")
    ap.add_argument("--runs", type=int, default=5, help="fresh daemons per layout and tree")
    ap.add_argument("--warm", type=int, default=10, help="warm hand-overs per run")
    ap.add_argument("--gap-s", type=float, default=1.5, help="idle gap after the warm-up")
    ap.add_argument("--log-dir", default="", help="keep the daemons' logs here")
    ap.add_argument("--num-blocks", type=int, default=SHAPE.num_blocks,
                    help="blocks per engine pool (128 KiB each)")
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    # `python -m kvd` puts the working directory first on the daemon's sys.path: run
    # from a neutral one, or a checkout there would shadow every tree's PYTHONPATH
    log_dir = os.path.abspath(args.log_dir) if args.log_dir else ""
    os.chdir(tempfile.gettempdir())
    out: dict[str, dict[str, list[dict[str, float]]]] = {}
    for layout in args.layout or list(LAYOUTS):
        for r in range(args.runs):
            for k, (name, path) in enumerate(trees):
                res = one_run(path, layout, args.warm, args.gap_s, f"{layout}{r}{k}",
                              log_dir, dataclasses.replace(SHAPE, num_blocks=args.num_blocks))
                out.setdefault(layout, {}).setdefault(name, []).append(res)
                print(f"{layout} run {r + 1} {name}: " + ", ".join(
                    f"{key} {v:.2f}" if "_x_" in key else
                    (f"{key} {v}" if isinstance(v, str) else f"{key} {v:.0f}")
                    for key, v in res.items()), flush=True)
    print("\nmedian over runs (first / warm p50):")
    for layout, by_tree in out.items():
        for name, runs in by_tree.items():
            print(f"  {layout:8s} {name:8s} daemon "
                  f"{statistics.median(r['first_x_warm_daemon'] for r in runs):.2f}x  wall "
                  f"{statistics.median(r['first_x_warm_wall'] for r in runs):.2f}x  "
                  f"(max {max(r['first_x_warm_wall'] for r in runs):.2f}x); a warm pull "
                  f"after the same gap: daemon "
                  f"{statistics.median(r['idle_x_warm_daemon'] for r in runs):.2f}x  wall "
                  f"{statistics.median(r['idle_x_warm_wall'] for r in runs):.2f}x")
    print(json.dumps({"load_avg_end": os.getloadavg(), "layouts": out}))


if __name__ == "__main__":
    main()

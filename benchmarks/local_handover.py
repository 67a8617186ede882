"""One daemon's local hand-overs, code trees side by side (a benchmark, not a test).

One ``kvd serve`` per tree with both engines of `kvd bench vllm`'s tiny Llama on it
(4 layers, 2 KV heads of 64, float32, 32-token blocks: 128 KiB per block), hand-overs
of 25 blocks (an 800-token prompt, 3.2 MB) from random producer blocks to random
consumer blocks, as the vLLM connector sends them: the publish with its receipt, then
the pull without waiting for its reply (`NoWaitClient`), then ``done_recving``. Per tree and round:

* single: one hand-over at a time; the engine's wall time (pull sent -> event) and the
  daemon's own ``duration_s``, p50;
* batch: ``--batch`` pulls sent back to back (one engine step's), wall time from the
  first sent to the last event, and the spread of the events' ``duration_s`` ends;
* the daemon's CPU time per hand-over (its process, from /proc: counted, not timed);
* to the daemon: from the engine's send of a pull to the daemon's read of it (the
  daemon's ``daemon_pull`` trace point, KVD_TRACE_DIR), p50 and p99 over every pull:
  on a busy host, how long the daemon waited for a CPU;
* memcpy: a single-thread ``np.copyto`` of the same bytes between two shm buffers
  4x the size of the CPU caches (cold, like a pull's blocks), timed alternately with
  the pulls: ratios to it are within one run.

Trees alternate round by round so that background load hits both alike:

    python benchmarks/local_handover.py --tree before=/path/a --tree after=/path/b

A tree is a kvd checkout; its daemon runs with ``PYTHONPATH`` set to it. The same
checkout twice with different settings (``--daemon-set NAME=KEY=VALUE``, repeatable)
compares settings; ``--spinners N`` runs N processes beside everything for the whole run
that call ``sched_yield`` in a loop, as vLLM's engine cores and workers do for a second
after every step (``--spin yield``), or that compute (``--spin busy``: a prefill, a hog):

    python benchmarks/local_handover.py --tree nice0=$PWD --tree nice-10=$PWD \
        --daemon-set nice0=cpu_nice=0 --daemon-set nice-10=cpu_nice=-10 --spinners 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvd.client.core import Messages
from kvd.client.nowait import NoWaitClient
from kvd.ops.trace import ENV as TRACE_ENV
from kvd.ops.trace import read_traces
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire.protocol import ModelSpec

MODEL = ModelSpec(name="tiny", num_kv_heads=2, num_layers=4, head_dim=64, dtype="float32")
SHAPE = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=512)
BLOCKS = 25
NBYTES = BLOCKS * 128 * 1024
COLD = 256 << 20  # memcpy buffers: far larger than the caches


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Memcpy:
    def __init__(self) -> None:
        self.src = np.ones(COLD, np.uint8)
        self.dst = np.zeros(COLD, np.uint8)
        self.dst[:] = 1  # faulted in now, not in the first timed copies
        self.rng = np.random.default_rng(7)

    def time(self) -> float:
        o = int(self.rng.integers(0, COLD - NBYTES)) & ~4095
        t = time.perf_counter()
        np.copyto(self.dst[o:o + NBYTES], self.src[o:o + NBYTES])
        return time.perf_counter() - t


SPIN = {"yield": "import os\nwhile True:\n    os.sched_yield()",  # vLLM's idle readers
        "busy": "while True:\n    pass"}  # threads that compute (a prefill, a hog)


def one_round(tree: str, singles: int, batches: int, batch: int, tag: str,
              memcpy: Memcpy, sets: tuple[str, ...] = ()) -> dict[str, float]:
    rng = np.random.default_rng(int(tag) if tag.isdigit() else 1)
    sent_ns: dict[str, int] = {}  # request id -> when the engine sent its pull
    with tempfile.TemporaryDirectory() as tmp:
        d = DaemonProcess.start(f"lh{tag}", Path(tmp),
                                [a for kv in sets for a in ("--set", kv)],
                                env={"PYTHONPATH": tree, TRACE_ENV: f"{tmp}/trace"})
        try:
            nowait = NoWaitClient(d.engine_address)
            with d.client(ping_interval_s=0, timeout_s=30) as c:
                p = c.register("pre", MODEL, layout_spec(SHAPE))
                c.register("dec", MODEL, layout_spec(SHAPE))
                p.kv.reshape(-1).view(np.uint8)[:] = 3

                def ids(k: int) -> list[int]:
                    return sorted(rng.choice(SHAPE.num_blocks, k, replace=False).tolist())

                def publish(rid: str) -> tuple[str, list[int], str]:
                    src = ids(BLOCKS)
                    return rid, src, c.publish("pre", rid, src)

                def send(rid: str, src: list[int], receipt: str, dst: list[int]) -> None:
                    # as the connector's scheduler: sent, not waited for
                    msg = Messages.pull("dec", rid, "pre", d.peer_address, src, dst, rid,
                                        num_tokens=-1, publish_receipt=receipt)
                    sent_ns[rid] = time.monotonic_ns()
                    assert nowait.send(msg, rid, time.monotonic())

                wall, daemon, mc, n = [], [], [], 0
                for i in range(singles + 5):  # 5 warm-ups
                    rid, src, receipt = publish(f"s{i}")
                    m = memcpy.time()
                    t0 = time.perf_counter()
                    send(rid, src, receipt, ids(BLOCKS))
                    ev = c.wait("dec", rid, "done_recving", timeout_s=20)
                    t1 = time.perf_counter()
                    assert ev.ok, ev.error
                    c.wait("pre", rid, "done_sending", timeout_s=20)
                    if i >= 5:
                        wall.append(t1 - t0)
                        daemon.append(ev.duration_s)
                        mc.append(m)
                cpu0 = _cpu_s(d.proc.pid)
                bwall, bspread = [], []
                for b in range(batches):
                    held = [publish(f"b{b}-{k}") for k in range(batch)]
                    dst = ids(BLOCKS * batch)
                    mc.append(memcpy.time())
                    t0 = time.perf_counter()
                    for k, (rid, src, receipt) in enumerate(held):
                        send(rid, src, receipt, dst[k * BLOCKS:(k + 1) * BLOCKS])
                    evs = [c.wait("dec", rid, "done_recving", timeout_s=20) for rid, *_ in held]
                    t1 = time.perf_counter()
                    assert all(e.ok for e in evs), [e.error for e in evs]
                    for rid, *_ in held:
                        c.wait("pre", rid, "done_sending", timeout_s=20)
                    n += batch
                    bwall.append(t1 - t0)
                    durations = sorted(e.duration_s for e in evs)
                    bspread.append(durations[-1] - durations[0])
                cpu = (_cpu_s(d.proc.pid) - cpu0) / max(n, 1)
                paths = {f.path for f in c.status().finished_pulls}
                assert paths == {"local"}, paths
                took = {rid: ns for ns, point, rid, _ in read_traces(f"{tmp}/trace")
                        if point == "daemon_pull"}
        finally:
            nowait.close()
            d.stop()
    m50 = statistics.median(mc)
    # the engine's send to the daemon's read of the pull: the daemon waiting for a CPU
    # (and ZMQ's I/O thread), nothing of the copy
    to_daemon = [(took[r] - t) / 1e3 for r, t in sent_ns.items() if r in took]
    return {"single_wall_p50_us": statistics.median(wall) * 1e6,
            "single_wall_p99_us": float(np.percentile(wall, 99)) * 1e6,
            "to_daemon_p50_us": statistics.median(to_daemon),
            "to_daemon_p99_us": float(np.percentile(to_daemon, 99)),
            "single_daemon_p50_us": statistics.median(daemon) * 1e6,
            "batch_wall_p50_us": statistics.median(bwall) * 1e6,
            "batch_duration_spread_p50_us": statistics.median(bspread) * 1e6,
            "daemon_cpu_per_handover_us": cpu * 1e6,
            "memcpy_p50_us": m50 * 1e6,
            "single_daemon_x_memcpy": statistics.median(daemon) / m50,
            "batch_wall_x_memcpy": statistics.median(bwall) / (m50 * batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--singles", type=int, default=100)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--daemon-set", action="append", default=[],
                    help="NAME=KEY=VALUE: a --set of that tree's daemon")
    ap.add_argument("--spinners", type=int, default=0,
                    help="loops beside everything for the whole run (--spin: what they do)")
    ap.add_argument("--spin", choices=sorted(SPIN), default="yield",
                    help="yield: sched_yield in a loop (vLLM's idle engines); busy: compute")
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    sets: dict[str, tuple[str, ...]] = {}
    for item in args.daemon_set:
        name, kv = item.split("=", 1)
        sets[name] = (*sets.get(name, ()), kv)
    # `python -m kvd` puts the working directory first on the daemon's sys.path: run
    # from a neutral one, or a checkout there would shadow every tree's PYTHONPATH
    os.chdir(tempfile.gettempdir())
    memcpy = Memcpy()
    out: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN[args.spin]])
                for _ in range(args.spinners)]
    try:
        for r in range(args.rounds):
            for k, (name, path) in enumerate(trees):
                res = one_round(path, args.singles, args.batches, args.batch, f"{r}{k}",
                                memcpy, sets.get(name, ()))
                out[name].append(res)
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{key} {v:.2f}" if "_x_" in key else f"{key} {v:.0f}"
                    for key, v in res.items()), flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(json.dumps({"load_avg_end": os.getloadavg(), "spinners": args.spinners,
                      "spin": args.spin,
                      "daemon_sets": sets, "trees": out}))


if __name__ == "__main__":
    main()

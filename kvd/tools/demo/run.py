"""`kvd demo`: the whole product on loopback, both pull paths, checked byte for byte.

Two daemons run as separate processes: a node daemon that hosts the prefill engine and
a same-node decode engine, and a second daemon (another node, as far as kvd can tell)
with a decode engine. Simulated engines register their ranks, the prefill engine writes
a deterministic KV pattern and publishes each request; then

- the same-node decode engine pulls from the node daemon's own peer address: the
  daemon copies the bytes itself (path "local": no network, no handshake);
- the other daemon's decode engine pulls through real NIXL (path "remote").

Each path pulls twice (the first pays page faults and, remotely, the handshake and
connection setup; the second is the steady state); every decode rank's pool is compared
with the shard it must hold after each pull, and the path is the one the consumer
daemon reports in its status. Nothing is left behind: the daemons stop (their pools
are unlinked; segment names carry this process's id) and the log folder is removed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec

PATHS = ("local", "remote")


def _pull_path(client: Any, request_id: str) -> str | None:
    """The path the consumer daemon reports for a finished pull."""
    for p in client.status().finished_pulls:
        if p.request_id == request_id:
            return p.path
    return None


def _show_logs(logs: Path) -> None:
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-20:]
        print(f"--- {log.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)


def run_demo(prefill_tp: int = 2, decode_tp: int = 1, prefill_pp: int = 1, decode_pp: int = 1,
             kv_heads: int = 8, layers: int = 16, head_dim: int = 128, tokens: int = 1024,
             prefill_block_size: int = 16, decode_block_size: int = 16, mla: bool = False) -> int:
    from kvd.planner import ModelGeometry, Parallelism, plan_transfer
    from kvd.tools.plan.render import render_table

    model = ModelSpec(name="demo-model", num_kv_heads=kv_heads, num_layers=layers,
                      head_dim=head_dim, dtype="bfloat16", mla=mla)
    p_blocks = -(-tokens // prefill_block_size)
    d_blocks = -(-tokens // decode_block_size)
    pshape = EngineShape(prefill_tp, prefill_pp, prefill_block_size, num_blocks=p_blocks * 2)
    dshape = EngineShape(decode_tp, decode_pp, decode_block_size, num_blocks=d_blocks * 2)
    plan = plan_transfer(ModelGeometry(kv_heads, layers, mla), Parallelism(prefill_tp, prefill_pp),
                         Parallelism(decode_tp, decode_pp))
    print(render_table(plan))
    print()
    logs = Path(tempfile.mkdtemp(prefix="kvd-demo-"))
    ok = False
    try:
        ok = _run(model, pshape, dshape, p_blocks, d_blocks, tokens, logs)
        return 0 if ok else 1
    finally:
        if not ok:
            _show_logs(logs)
        shutil.rmtree(logs, ignore_errors=True)


def _run(model: ModelSpec, pshape: EngineShape, dshape: EngineShape, p_blocks: int,
         d_blocks: int, tokens: int, logs: Path) -> bool:
    # Segment names unique to this run: two demos at once never meet, and a check that
    # nothing was left behind can look for exactly these.
    tag = f"kvd-demo-{os.getpid()}"
    # The other daemon stands for another node: NIXL READs, not the host path.
    nodes = ["--set", "host_pulls=false"]
    node = DaemonProcess.start("node", logs,
                               extra_args=["--set", f"shm_prefix={tag}-node", *nodes])
    try:
        other = DaemonProcess.start("other", logs,
                                    extra_args=["--set", f"shm_prefix={tag}-other", *nodes])
    except BaseException:
        node.stop()
        raise
    nc, oc = node.client(), other.client()
    try:
        g = global_kv(model, tokens)
        rng = random.Random(7)
        p_ids = rng.sample(range(pshape.num_blocks), p_blocks)
        d_ids = rng.sample(range(dshape.num_blocks), d_blocks)
        p_ranks = [nc.register("prefill-0", model, layout_spec(pshape), t, pshape.tp_size, p,
                               pshape.pp_size)
                   for p in range(pshape.pp_size) for t in range(pshape.tp_size)]
        for r in p_ranks:
            write_shard(r.kv, g, model, pshape, r.tp_rank, r.pp_rank, p_ids)
        # the consumers: one on the prefill engine's own daemon, one on the other daemon
        consumers = {"local": (nc, "decode-local"), "remote": (oc, "decode-0")}
        d_ranks = {path: [c.register(eng, model, layout_spec(dshape), t, dshape.tp_size, p,
                                     dshape.pp_size)
                          for p in range(dshape.pp_size) for t in range(dshape.tp_size)]
                   for path, (c, eng) in consumers.items()}
        runs: list[dict[str, Any]] = []
        for path in PATHS:
            client, eng = consumers[path]
            for n in (1, 2):
                rid = f"{path}-{n}"
                for r in d_ranks[path]:
                    r.kv.fill(0)
                nc.publish("prefill-0", rid, p_ids)
                t0 = time.perf_counter()
                # both name the prefill engine's daemon by its peer address, as any engine
                # does: the node daemon recognises itself and copies
                client.pull(eng, rid, "prefill-0", node.peer_address, p_ids, d_ids)
                ev = client.wait(eng, rid, "done_recving", timeout_s=60)
                elapsed_s = time.perf_counter() - t0
                sent = nc.wait("prefill-0", rid, "done_sending", timeout_s=10)
                if not ev.ok:
                    print(f"FAILED: pull {rid} did not complete: {ev.error}")
                    return False
                bad = sum(check_shard(r.kv, g, model, dshape, r.tp_rank, r.pp_rank, d_ids)
                          for r in d_ranks[path])
                shown = _pull_path(client, rid)
                runs.append({
                    "request": rid,
                    "path": shown,
                    "ok": bad == 0 and sent.ok and shown == path,
                    "mismatched_elements": bad,
                    "nbytes": ev.nbytes,
                    "seconds": round(elapsed_s, 4),
                    "gbps": round(ev.nbytes / elapsed_s / 1e9, 2),
                    "producer_released": sent.ok,
                })
                print(json.dumps(runs[-1]))
        if not all(r["ok"] for r in runs):
            print("FAILED: decode pools differ from the expected shards, or a pull took "
                  "another path than expected")
            return False
        by = {r["request"]: r for r in runs}
        mib = runs[0]["nbytes"] / 2**20
        print(f"OK: {mib:.1f} MiB pulled from prefill TP{pshape.tp_size}xPP{pshape.pp_size} "
              f"to decode TP{dshape.tp_size}xPP{dshape.pp_size}, byte-exact on both paths, "
              "end to end (first pull / second pull): "
              f"same node, one daemon (local copy) {by['local-1']['seconds'] * 1e3:.1f} ms / "
              f"{by['local-2']['seconds'] * 1e3:.1f} ms ({by['local-2']['gbps']} GB/s); "
              f"two daemons (NIXL) {by['remote-1']['seconds'] * 1e3:.1f} ms incl. handshake / "
              f"{by['remote-2']['seconds'] * 1e3:.1f} ms ({by['remote-2']['gbps']} GB/s)")
        return True
    finally:
        nc.close()
        oc.close()
        node.stop()
        other.stop()

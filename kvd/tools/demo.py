"""`kvd demo`: the whole product on loopback, checked byte for byte.

Two daemons run as separate processes (a prefill node and a decode node). Simulated
engines register their ranks, the prefill engine writes a deterministic KV pattern,
publishes the request, the decode engine pulls it through real NIXL, and every
decode rank's pool is compared with the shard it must hold.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec


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
    # Two daemons standing for two nodes: NIXL READs, not the host path.
    nodes = ["--set", "host_pulls=false"]
    prefill = DaemonProcess.start("prefill", logs, extra_args=nodes)
    decode = DaemonProcess.start("decode", logs, extra_args=nodes)
    pc, dc = prefill.client(), decode.client()
    try:
        g = global_kv(model, tokens)
        rng = random.Random(7)
        p_ids = rng.sample(range(pshape.num_blocks), p_blocks)
        d_ids = rng.sample(range(dshape.num_blocks), d_blocks)
        p_ranks = [pc.register("prefill-0", model, layout_spec(pshape), t, prefill_tp, p,
                               prefill_pp) for p in range(prefill_pp) for t in range(prefill_tp)]
        d_ranks = [dc.register("decode-0", model, layout_spec(dshape), t, decode_tp, p, decode_pp)
                   for p in range(decode_pp) for t in range(decode_tp)]
        for r in p_ranks:
            write_shard(r.kv, g, model, pshape, r.tp_rank, r.pp_rank, p_ids)
        # Two pulls: the first pays the handshake, NIXL connection setup and first-touch
        # page faults; the second is the steady state. Both are checked byte for byte.
        runs = []
        for rid in ("req-1", "req-2"):
            for r in d_ranks:
                r.kv.fill(0)
            pc.publish("prefill-0", rid, p_ids)
            t0 = time.perf_counter()
            dc.pull("decode-0", rid, "prefill-0", prefill.peer_address, p_ids, d_ids)
            ev = dc.wait("decode-0", rid, "done_recving", timeout_s=60)
            elapsed_s = time.perf_counter() - t0
            sent = pc.wait("prefill-0", rid, "done_sending", timeout_s=10)
            if not ev.ok:
                print(f"FAILED: pull {rid} did not complete: {ev.error}")
                return 1
            bad = sum(check_shard(r.kv, g, model, dshape, r.tp_rank, r.pp_rank, d_ids)
                      for r in d_ranks)
            runs.append({
                "request": rid,
                "ok": bad == 0 and sent.ok,
                "mismatched_elements": bad,
                "nbytes": ev.nbytes,
                "seconds": round(elapsed_s, 4),
                "gbps": round(ev.nbytes / elapsed_s / 1e9, 2),
                "producer_released": sent.ok,
            })
            print(json.dumps(runs[-1]))
        if all(r["ok"] for r in runs):
            cold, warm = runs
            print(f"OK: {cold['nbytes'] / 2**20:.1f} MiB pulled from prefill TP{prefill_tp}xPP"
                  f"{prefill_pp} to decode TP{decode_tp}xPP{decode_pp}, byte-exact: first pull "
                  f"{cold['seconds'] * 1e3:.1f} ms incl. handshake ({cold['gbps']} GB/s), "
                  f"second {warm['seconds'] * 1e3:.1f} ms ({warm['gbps']} GB/s) end to end")
            return 0
        print("FAILED: decode pools differ from the expected shards")
        return 1
    finally:
        pc.close()
        dc.close()
        prefill.stop()
        decode.stop()

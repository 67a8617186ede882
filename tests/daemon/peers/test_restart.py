"""kill -9 and restart of each side, real processes and NIXL: no pull fails forever.

Each daemon incarnation has a random instance id that its peers see in every
reply. A prefill daemon killed during pulls fails them promptly with ``peer_lost``;
restarted on the same address with the same engine id, the first pull of a newly
published request succeeds without any retry by the engine. A decode daemon
killed while the prefill side holds requests: restarted, its re-registered engine
pulls them again and the producer is released ``ok``.

What an engine does after its local daemon restarted: its pings fail with
``not_found`` ("not registered"), ``on_lost`` fires; it registers again and gets
a NEW pool here (test_adopt_restart.py has it adopt the old one instead), so every
block it held is gone: requests in flight on the old incarnation never report success.
The old pool file stays while the engine maps it (reaping skips it) and goes after.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support.restart import (
    BIG,
    MODEL,
    SMALL_IDS,
    cleanup,
    kill9,
    pull_small,
    start_daemon,
)

from kvd.pool.owner import reap_dead_pools
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.sim import check_shard, global_kv, layout_spec, write_shard

pytestmark = pytest.mark.nixl

def test_prefill_daemon_killed_then_restarted_is_greeted_again(tmp_path: Path) -> None:
    prefill, decode = start_daemon(tmp_path, "rkp"), start_daemon(tmp_path, "rkd")
    started = [prefill, decode]  # every incarnation, so a failed assertion leaks none
    lost = threading.Event()
    g = global_kv(MODEL, len(SMALL_IDS) * 16)
    try:
        with prefill.client(ping_interval_s=0.2, on_lost=lambda _: lost.set()) as pc, \
                decode.client() as dc:
            pre = pc.register("pre", MODEL, layout_spec(BIG))
            dec = dc.register("dec", MODEL, layout_spec(BIG))
            write_shard(pre.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
            recv, _ = pull_small(pc, dc, prefill.peer_address, "warm", [10, 11, 12])
            assert recv.ok, recv.error  # the handshake is cached now
            # Big pulls in flight, then kill -9 (best effort: mid-READ).
            src = pre.kv.view(np.uint64).reshape(-1)
            src[:] = np.arange(src.size, dtype=np.uint64)
            rng = random.Random(3)
            reqs = []
            for i in range(4):
                ids = rng.sample(range(BIG.num_blocks), 128)
                pc.publish("pre", f"big{i}", ids)
                reqs.append((f"big{i}", ids))
            for rid, ids in reqs:
                dc.pull("dec", rid, "pre", prefill.peer_address, ids, ids)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any(  # its Acquire out, or reading
                    j.state in ("acquiring", "reading") for j in dc.status().pulls):
                pass
            kill9(prefill)
            t0 = time.monotonic()
            failed = []
            for rid, ids in reqs:
                ev = dc.wait("dec", rid, "done_recving", timeout_s=30)
                if ev.ok:  # finished before the kill: exact
                    assert np.array_equal(dec.kv[:, :, ids], pre.kv[:, :, ids]), rid
                else:
                    assert ev.invalid_block_ids == ids and ev.nbytes == 0
                    failed.append(ev)
            assert failed, "the kill landed after every pull had finished"
            assert all(ev.error.startswith("peer_lost") for ev in failed), \
                [ev.error for ev in failed]
            assert time.monotonic() - t0 < 10, "pulls against the dead daemon were not prompt"
            # A pull while nothing answers at that address fails promptly, too.
            dc.pull("dec", "while-down", "pre", prefill.peer_address, SMALL_IDS, [1, 2, 4])
            ev = dc.wait("dec", "while-down", "done_recving", timeout_s=15)
            assert not ev.ok and ev.error.split(":")[0] in ("peer_lost", "timeout"), ev.error

            # Restart on the same addresses; the engine hears it and registers again.
            leftovers = kvd_segments(f"kvd-{prefill.name}")
            assert leftovers, "kill -9 should have left the pool file behind"
            again = start_daemon(tmp_path, "rkp", like=prefill)
            started.append(again)
            assert set(leftovers) <= set(kvd_segments(f"kvd-{prefill.name}")), \
                "the restarted daemon reaped a pool the engine still maps"
            assert lost.wait(10), "the engine never noticed its daemon restarted"
            pre2 = pc.register("pre", MODEL, layout_spec(BIG))
            assert pre2.instance_id and pre2.instance_id != pre.instance_id
            write_shard(pre2.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
            recv, sent = pull_small(pc, dc, again.peer_address, "after", [20, 21, 22])
            assert recv.ok, f"first pull after the restart failed: {recv.error}"
            assert sent.ok
            assert check_shard(dec.kv, g, MODEL, BIG, 0, 0, [20, 21, 22]) == 0
            [peer] = dc.status().peers
            assert peer.instance == pc.status().instance_id
            assert not reap_dead_pools(SHM_DIR, f"kvd-{prefill.name}")  # still mapped
            prefill = again
    finally:
        cleanup(*started)


def test_decode_daemon_killed_then_restarted_pulls_what_the_prefill_holds(tmp_path: Path
                                                                          ) -> None:
    prefill, decode = start_daemon(tmp_path, "rdp"), start_daemon(tmp_path, "rdd")
    g = global_kv(MODEL, len(SMALL_IDS) * 16)
    try:
        with prefill.client() as pc:
            pre = pc.register("pre", MODEL, layout_spec(BIG))
            write_shard(pre.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
            with decode.client(ping_interval_s=0) as dc:
                dc.register("dec", MODEL, layout_spec(BIG))
                recv, _ = pull_small(pc, dc, prefill.peer_address, "warm", [10, 11, 12])
                assert recv.ok, recv.error
                # A 259-block request (~260 MiB): its READ cannot end, and no READ notice
                # releases the hold, within the moment before the kill (a 3-block pull
                # sometimes did, and the producer then rightly let the request go).
                held_ids = SMALL_IDS + list(range(64, 320))
                pc.publish("pre", "held", held_ids, lease_s=60)
                dc.pull("dec", "held", "pre", prefill.peer_address, held_ids,
                        [1, 2, 4, *range(100, 356)], num_tokens=len(held_ids) * 16)
                kill9(decode)  # mid-pull at the latest: the producer still holds "held"
            again = start_daemon(tmp_path, "rdd", like=decode)
            decode = again
            with again.client() as dc:
                dec = dc.register("dec", MODEL, layout_spec(BIG))
                dc.pull("dec", "held", "pre", prefill.peer_address, SMALL_IDS, [5, 6, 8],
                        num_tokens=len(SMALL_IDS) * 16)
                recv = dc.wait("dec", "held", "done_recving", timeout_s=20)
                assert recv.ok, f"pull by the restarted decode daemon failed: {recv.error}"
                assert check_shard(dec.kv, g, MODEL, BIG, 0, 0, [5, 6, 8]) == 0
                sent = pc.wait("pre", "held", "done_sending", timeout_s=20)
                assert sent.ok, sent.error
    finally:
        cleanup(prefill, decode)

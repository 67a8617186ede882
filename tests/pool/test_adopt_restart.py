"""A daemon restart does not cost an engine its KV memory.

Real processes and NIXL: a decode daemon is killed (-9) under an engine that keeps its
pool mapped; the restarted daemon's crash-leftover reaping keeps the file (the engine
holds a shared flock on it), the engine registers again asking the new daemon to adopt
the pool, and a P->D pull into that same memory is byte-exact while the bytes the
engine wrote before the restart are intact. Once the engine deregisters, the new daemon
frees the pool (it owns it now).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
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

from kvd.errors import InvalidRequestError, KvdError
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.sim import check_shard, global_kv, layout_spec, write_shard

pytestmark = pytest.mark.nixl

KEPT_IDS = [40, 41, 42, 43]  # blocks the decode engine wrote before the restart


def test_decode_daemon_restarted_adopts_the_engines_pool(tmp_path: Path) -> None:
    prefill, decode = start_daemon(tmp_path, "adp"), start_daemon(tmp_path, "add")
    g = global_kv(MODEL, len(SMALL_IDS) * 16)
    try:
        with prefill.client() as pc, decode.client(ping_interval_s=0) as dc:
            pre = pc.register("pre", MODEL, layout_spec(BIG))
            dec = dc.register("dec", MODEL, layout_spec(BIG))
            write_shard(pre.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
            recv, _ = pull_small(pc, dc, prefill.peer_address, "warm", [10, 11, 12])
            assert recv.ok, recv.error
            kept = global_kv(MODEL, len(KEPT_IDS) * 16, seed=7)
            write_shard(dec.kv, kept, MODEL, BIG, 0, 0, KEPT_IDS)
            before = dec.kv.copy()
            old_name = dec.pool.handle.name

            kill9(decode)
            t_restart = time.monotonic()
            again = start_daemon(tmp_path, "add", like=decode)
            decode = again
            assert old_name in kvd_segments(f"kvd-{again.name}"), \
                "the new daemon reaped a pool a live engine still maps"

            dec2 = dc.adopt_rank(dec)
            t_adopted = time.monotonic()
            assert dec2.instance_id and dec2.instance_id != dec.instance_id
            assert dec2.pool is dec.pool  # the same mapping: nothing moved, nothing copied
            assert dec2.pool.handle.name != old_name  # renamed into the new incarnation
            assert old_name not in kvd_segments(f"kvd-{again.name}")
            with pytest.raises(KvdError, match="already registered"):
                dc.adopt_rank(dec)  # once only
            memfd = msgspec.structs.replace(dec2.pool.handle, name="7", directory="/proc/1/fd")
            with pytest.raises(InvalidRequestError, match="cannot adopt memfd pool"):
                dc.call(msgspec.structs.replace(dec.registration, engine_id="other",
                                                adopt_pool=memfd))

            write_shard(pre.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
            recv, sent = pull_small(pc, dc, prefill.peer_address, "after", [20, 21, 22])
            t_ok = time.monotonic()
            assert recv.ok, f"first pull after adoption failed: {recv.error}"
            assert sent.ok, sent.error
            assert check_shard(dec2.kv, g, MODEL, BIG, 0, 0, [20, 21, 22]) == 0
            assert check_shard(dec2.kv, kept, MODEL, BIG, 0, 0, KEPT_IDS) == 0, \
                "the engine's pre-restart bytes changed"
            changed = np.flatnonzero((dec2.kv != before).reshape(-1))
            assert changed.size, "the pull wrote nothing"
            print(f"\ndecode daemon restart -> adopted {t_adopted - t_restart:.2f}s, "
                  f"-> first P->D pull ok {t_ok - t_restart:.2f}s "
                  f"({t_ok - t_adopted:.3f}s after adoption)")
            new_name = dec2.pool.handle.name
            dc.deregister(dec2)
            deadline = time.monotonic() + 10
            while new_name in kvd_segments(f"kvd-{again.name}") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert new_name not in kvd_segments(f"kvd-{again.name}"), \
                "the new daemon did not free the adopted pool when the engine went"
    finally:
        cleanup(prefill, decode)
        for name in kvd_segments("kvd-add"):
            (SHM_DIR / name).unlink(missing_ok=True)

"""A daemon restart does not cost an engine its memfd pool.

A memfd pool has no file a new daemon could open by name. The engine keeps its own fd
of it (opened through ``/proc/<kvd pid>/fd/<n>``) and hands it back the same way: its
adoption request names ``/proc/<engine pid>/fd/<its fd>`` (kvd.pool.adopt). Real
processes and NIXL: the decode daemon is killed (-9) twice under an engine, each new
incarnation adopts the engine's memfd, and a P->D pull into that same memory is
byte-exact while the bytes the engine wrote before the restarts are intact. Plain
``memfd`` pools (4 KiB pages) here; ``memfd_hugetlb`` takes the same path and needs
reserved huge pages this host does not have.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from support.restart import BIG, MODEL, SMALL_IDS, cleanup, kill9, pull_small

from kvd.errors import InvalidRequestError, KvdError
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import check_shard, global_kv, layout_spec, write_shard

pytestmark = pytest.mark.nixl

ARGS = ["--set", "handshake_timeout_s=2", "--set", "heartbeat_interval_s=0.5",
        "--set", "pool_backing=memfd"]
KEPT_IDS = [40, 41, 42, 43]


def _start(tmp: Path, name: str, like: DaemonProcess | None = None) -> DaemonProcess:
    if like is None:
        return DaemonProcess.start(name, tmp, extra_args=ARGS)
    return DaemonProcess.start(name, tmp / f"again-{time.monotonic_ns()}", extra_args=ARGS,
                               engine_address=like.engine_address,
                               peer_address=like.peer_address)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_decode_daemon_restarted_twice_adopts_the_engines_memfd(tmp_path: Path) -> None:
    prefill, decode = _start(tmp_path, "amp"), _start(tmp_path, "amd")
    started = [prefill, decode]
    g = global_kv(MODEL, len(SMALL_IDS) * 16)
    try:
        with prefill.client() as pc, decode.client(ping_interval_s=0) as dc:
            pre = pc.register("pre", MODEL, layout_spec(BIG))
            dec = dc.register("dec", MODEL, layout_spec(BIG))
            assert dec.pool.handle.directory == f"/proc/{decode.proc.pid}/fd", \
                "not a memfd pool"
            write_shard(pre.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
            recv, _ = pull_small(pc, dc, prefill.peer_address, "warm", [10, 11, 12])
            assert recv.ok, recv.error
            kept = global_kv(MODEL, len(KEPT_IDS) * 16, seed=7)
            write_shard(dec.kv, kept, MODEL, BIG, 0, 0, KEPT_IDS)
            fds = _fd_count()

            handle = dec
            for round_ in range(2):
                before = handle.kv.copy()
                kill9(decode)
                t_restart = time.monotonic()
                decode = _start(tmp_path, "amd", like=decode)
                started.append(decode)
                new = dc.adopt_rank(handle)
                t_adopted = time.monotonic()
                assert new.instance_id != handle.instance_id
                assert new.pool is dec.pool  # the same mapping: nothing moved or copied
                assert new.pool.handle.directory == f"/proc/{decode.proc.pid}/fd"
                with pytest.raises(KvdError, match="already registered"):
                    dc.adopt_rank(new)  # once only (the rank, then the memfd itself)
                with pytest.raises(InvalidRequestError, match="already registered here"):
                    dc.call(msgspec.structs.replace(
                        dec.registration, engine_id="other",
                        adopt_pool=new.pool.adoption_handle()))
                dst = [20 + 3 * round_, 21 + 3 * round_, 22 + 3 * round_]
                write_shard(pre.kv, g, MODEL, BIG, 0, 0, SMALL_IDS)
                recv, sent = pull_small(pc, dc, prefill.peer_address, f"after{round_}", dst)
                t_ok = time.monotonic()
                assert recv.ok, f"first pull after adoption failed: {recv.error}"
                assert sent.ok, sent.error
                assert check_shard(new.kv, g, MODEL, BIG, 0, 0, dst) == 0
                assert check_shard(new.kv, kept, MODEL, BIG, 0, 0, KEPT_IDS) == 0, \
                    "the engine's pre-restart bytes changed"
                changed = np.flatnonzero((new.kv != before).reshape(-1))
                assert changed.size, "the pull wrote nothing"
                print(f"\nmemfd round {round_}: decode daemon restart -> adopted "
                      f"{t_adopted - t_restart:.2f}s, -> first P->D pull ok "
                      f"{t_ok - t_restart:.2f}s")
                handle = new
            assert _fd_count() == fds, "adoption leaked or dropped an fd in the engine"
            dc.deregister(handle)
    finally:
        cleanup(*started)


def test_memfd_adoption_refusals(tmp_path: Path) -> None:
    """One line each, nothing taken: a live daemon's memfd (its own), a fd that is not
    a memfd, a memfd of another prefix, a path that is not /proc/<pid>/fd/<n>."""
    decode = _start(tmp_path, "amr")
    other = _start(tmp_path, "amo")
    try:
        with decode.client(ping_interval_s=0) as dc, other.client(ping_interval_s=0) as oc:
            dec = dc.register("dec", MODEL, layout_spec(BIG))
            foreign = oc.register("foreign", MODEL, layout_spec(BIG))

            def adopt(directory: str, name: str) -> str:
                pool = msgspec.structs.replace(dec.pool.handle, directory=directory,
                                               name=name)
                with pytest.raises(InvalidRequestError) as info:
                    dc.call(msgspec.structs.replace(dec.registration, engine_id="x",
                                                    adopt_pool=pool))
                return str(info.value)

            mine = dec.pool.adoption_handle()  # the live daemon's own memfd, via our fd
            assert "alive" in adopt(mine.directory, mine.name)
            own = dec.pool.handle  # the daemon's own /proc/<pid>/fd entry
            assert "own fd" in adopt(own.directory, own.name)
            with open(tmp_path / "plain", "wb") as f:
                assert "not a memfd" in adopt(f"/proc/{os.getpid()}/fd", str(f.fileno()))
            theirs = foreign.pool.adoption_handle()
            assert "not a pool of prefix" in adopt(theirs.directory, theirs.name)
            assert "shm_dir" in adopt("/proc/self/fd", "3")  # not a memfd path: a file
            assert "not /proc/<pid>/fd/<n>" in adopt(f"/proc/{os.getpid()}/fd", "../x")
            assert [e.engine_id for e in dc.status().engines] == ["dec"]
    finally:
        cleanup(decode, other)

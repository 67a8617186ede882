"""Daemons as real processes (kvd serve, NIXL), one checked transfer case, metrics.

The ``pair`` fixture (tests/conftest.py) starts one prefill and one decode daemon per
module with these helpers; tests/support/inprocess.py is the in-process counterpart.

A case registers fresh engine ids on a prefill daemon and a decode daemon,
writes the global KV pattern into the prefill pools, publishes, pulls, waits
for both completion events and checks every decode rank byte for byte (and
that no block outside the pulled ones was written). It then deregisters every
rank and waits until the daemons have freed the pools.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvd.client import KvdClient, RankHandle
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, blocks_view, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import Event, ModelSpec


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_until(pred: Callable[[], object], timeout_s: float = 10.0, every_s: float = 0.05,
               what: str = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def start_daemon(tmp: Path, role: str, extra_args: list[str] | None = None) -> DaemonProcess:
    # A unique name keeps our /dev/shm prefix apart from other runs on the machine.
    return DaemonProcess.start(unique(f"it{role}"), tmp, extra_args=extra_args)


def shm_prefix(d: DaemonProcess) -> str:
    return f"kvd-{d.name}"


def stop_and_check_clean(d: DaemonProcess) -> None:
    """SIGTERM, expect exit 0 and no leftover segment of that daemon."""
    rc = d.stop()
    leftovers = kvd_segments(shm_prefix(d))
    for name in leftovers:  # never leave junk in /dev/shm, even when failing
        (SHM_DIR / name).unlink(missing_ok=True)
    assert rc == 0, f"{d.name} exited with {rc}:\n{d.log_path.read_text()[-3000:]}"
    assert not leftovers, f"{d.name} left shm segments {leftovers}"


@dataclass
class Pair:
    prefill: DaemonProcess
    decode: DaemonProcess
    pc: KvdClient
    dc: KvdClient


@contextmanager
def running_pair(logs: Path, args: list[str]) -> Iterator[Pair]:
    """A prefill and a decode ``kvd serve`` with ``args``, each with a client; both are
    stopped and checked clean (no pool left in /dev/shm) on the way out."""
    prefill = start_daemon(logs, "p", args)
    try:
        decode = start_daemon(logs, "d", args)
    except BaseException:
        prefill.kill()
        raise
    pc, dc = prefill.client(), decode.client()
    try:
        yield Pair(prefill, decode, pc, dc)
    finally:
        pc.close()
        dc.close()
        try:
            stop_and_check_clean(prefill)
        finally:
            stop_and_check_clean(decode)


def metric(d: DaemonProcess, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    return d.metric(name, **labels)


@dataclass
class Engine:
    engine_id: str
    model: ModelSpec
    shape: EngineShape
    ranks: list[RankHandle] = field(default_factory=list)
    layer_partition: list[int] | None = None


def register(client: KvdClient, prefix: str, model: ModelSpec, shape: EngineShape) -> Engine:
    e = Engine(unique(prefix), model, shape)
    for p in range(shape.pp_size):
        for t in range(shape.tp_size):
            e.ranks.append(client.register(e.engine_id, model, layout_spec(shape), t,
                                           shape.tp_size, p, shape.pp_size))
    return e


def pools_of(client: KvdClient, engine_ids: set[str]) -> list[str]:
    return [e.pool for e in client.status().engines if e.engine_id in engine_ids]


def deregister_and_check_freed(client: KvdClient, *engines: Engine, timeout_s: float = 10.0
                               ) -> None:
    """Deregister every rank; the daemon must drop the ranks and unlink their pools."""
    ids = {e.engine_id for e in engines}
    pools = pools_of(client, ids)
    assert len(pools) == sum(len(e.ranks) for e in engines)
    for e in engines:
        for r in e.ranks:
            client.deregister(r)
    wait_until(lambda: not pools_of(client, ids), timeout_s, what=f"engines {ids} to be freed")
    wait_until(lambda: not any((SHM_DIR / p).exists() for p in pools), timeout_s,
               what=f"pools {pools} to be unlinked")


def untouched_blocks_nonzero(pool: np.ndarray, shape: EngineShape, written: list[int]) -> int:
    """Elements outside ``written`` blocks that are not zero (a fresh pool is all zeros)."""
    view = blocks_view(pool, shape.kv_layout, shape.head_layout)
    others = sorted(set(range(shape.num_blocks)) - set(written))
    return int(np.count_nonzero(view[others])) if others else 0


@dataclass
class CaseResult:
    recv: Event
    sent: Event
    mismatches: int
    stray: int
    local_ids: list[int]


def run_transfer(prefill: DaemonProcess, decode: DaemonProcess, pc: KvdClient, dc: KvdClient,
                 model: ModelSpec, pshape: EngineShape, dshape: EngineShape, tokens: int,
                 skip_tokens: int = 0, zero_local: bool = False, seed: int = 3,
                 timeout_s: float = 30.0,
                 block_ids: tuple[list[int], list[int]] | None = None) -> CaseResult:
    """One request prefill -> decode, checked; engines are deregistered and freed at the end.

    ``block_ids``: (prefill ids, decode ids) instead of random ones (e.g. contiguous)."""
    rng = random.Random(seed)
    p = register(pc, "pre", model, pshape)
    d = register(dc, "dec", model, dshape)
    try:
        g = global_kv(model, tokens, seed=seed)
        n_remote = -(-tokens // pshape.block_size_tokens)
        assert skip_tokens % dshape.block_size_tokens == 0
        assert skip_tokens % pshape.block_size_tokens == 0
        n_local = 0 if zero_local else -(-(tokens - skip_tokens) // dshape.block_size_tokens)
        p_ids = rng.sample(range(pshape.num_blocks), n_remote)
        d_ids = rng.sample(range(dshape.num_blocks), n_local)
        if block_ids is not None:
            p_ids, d_ids = list(block_ids[0]), list(block_ids[1])
        for r in p.ranks:
            write_shard(r.kv, g, model, pshape, r.tp_rank, r.pp_rank, p_ids)
        rid = unique("req")
        pc.publish(p.engine_id, rid, p_ids)
        dc.pull(d.engine_id, rid, p.engine_id, prefill.peer_address, p_ids, d_ids,
                num_tokens=tokens)
        recv = dc.wait(d.engine_id, rid, "done_recving", timeout_s=timeout_s)
        sent = pc.wait(p.engine_id, rid, "done_sending", timeout_s=timeout_s)
        mismatches = stray = 0
        if recv.ok:
            for r in d.ranks:
                mismatches += check_shard(r.kv, g, model, dshape, r.tp_rank, r.pp_rank, d_ids,
                                          first_token=skip_tokens)
                stray += untouched_blocks_nonzero(r.kv, dshape, d_ids)
        return CaseResult(recv, sent, mismatches, stray, d_ids)
    finally:
        deregister_and_check_freed(pc, p)
        deregister_and_check_freed(dc, d)


def kill_producer_mid_pulls(dc: KvdClient, victim: DaemonProcess, model: ModelSpec,
                            shape: EngineShape, requests: int, prefix: str, seed: int
                            ) -> tuple[Engine, list[bool]]:
    """Publish ``requests`` pulls' worth of fragmented blocks on ``victim`` (every 8 bytes
    distinct), pull them all through ``dc``, SIGKILL the victim while a READ runs (best
    effort: failing earlier is accepted too), and check each outcome: a pull that
    finished before the kill holds exactly the right bytes, one that failed names every
    local block invalid and no bytes. Returns the decode engine and the outcomes; at
    least one pull must have failed (else the kill came too late to test anything)."""
    with victim.client() as vc:
        p = register(vc, "pre", model, shape)
        d = register(dc, "dec", model, shape)
        src = p.ranks[0].kv
        words = src.view(np.uint64).reshape(-1)
        words[:] = np.arange(words.size, dtype=np.uint64)
        rng = random.Random(seed)
        p_ids = rng.sample(range(shape.num_blocks), shape.num_blocks)
        d_ids = rng.sample(range(shape.num_blocks), shape.num_blocks)
        per = shape.num_blocks // requests
        reqs = []
        for i in range(requests):
            rid = f"{prefix}-{i}"
            pi, di = p_ids[i * per:(i + 1) * per], d_ids[i * per:(i + 1) * per]
            vc.publish(p.engine_id, rid, pi)
            reqs.append((rid, pi, di))
        for rid, pi, di in reqs:
            dc.pull(d.engine_id, rid, p.engine_id, victim.peer_address, pi, di)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(  # its Acquire out, or reading
                j.state in ("acquiring", "reading") for j in dc.status().pulls):
            pass
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        outcomes = []
        dst = d.ranks[0].kv
        for rid, pi, di in reqs:
            ev = dc.wait(d.engine_id, rid, "done_recving", timeout_s=30)
            outcomes.append(ev.ok)
            if ev.ok:  # pool (L, kv, block, H, T, D): compare whole blocks
                assert np.array_equal(dst[:, :, di], src[:, :, pi]), rid
            else:
                assert ev.invalid_block_ids == di, ev
                assert ev.nbytes == 0
        assert not all(outcomes), "the kill landed after every transfer had finished"
        return d, outcomes

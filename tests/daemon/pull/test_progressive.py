"""Progressive pulls between real daemon processes: the decode's daemon pulls before the
prefill has sealed anything, reads each sealed range as it comes (NIXL READs between two
daemons, host_pulls off; and the local copy on one daemon), and is byte-exact; every
failure (an unseal, an abort on either side, the producer's engine or daemon gone or
frozen, a hold timeout) ends never ok with wrong bytes, with every local block invalid.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from support.cluster import (
    Engine,
    deregister_and_check_freed,
    register,
    start_daemon,
    stop_and_check_clean,
    unique,
    untouched_blocks_nonzero,
    wait_until,
)
from support.matrix_cases import model, shape

from kvd.client import KvdClient
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, write_shard
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

# NIXL READs between the two daemons, not the same-host copy; a frozen peer fails fast
DAEMON_ARGS = ["--set", "host_pulls=false", "--set", "handshake_timeout_s=2"]
MODEL = model()
HOST = ["--set", "host_pulls=true"]  # the suite's default is off (tests/conftest.py)


@dataclass
class Case:
    p: Engine
    d: Engine
    rid: str
    p_ids: list[int]
    d_ids: list[int]
    tokens: int
    skip: int


def start_case(pc: KvdClient, dc: KvdClient, paddr: str, m: ModelSpec, pshape: EngineShape,
               dshape: EngineShape, tokens: int, skip: int = 0, seed: int = 3,
               hold_timeout_s: float = 0.0) -> Case:
    """Register both engines and issue the progressive pull: nothing is sealed yet."""
    rng = random.Random(seed)
    p = register(pc, "pre", m, pshape)
    d = register(dc, "dec", m, dshape)
    p_ids = rng.sample(range(pshape.num_blocks), -(-tokens // pshape.block_size_tokens))
    d_ids = rng.sample(range(dshape.num_blocks), -(-(tokens - skip) // dshape.block_size_tokens))
    rid = unique("prog")
    dc.progressive_pull(d.engine_id, rid, p.engine_id, paddr, d_ids, num_tokens=tokens,
                        hold_timeout_s=hold_timeout_s)
    return Case(p, d, rid, p_ids, d_ids, tokens, skip)


def compute(pc: KvdClient, c: Case, g, start: int, end: int, blocks: list[int] | None = None,
            generation: int = 0, complete: bool = False, consumers: int = 1) -> None:
    """The prefill computes tokens [start, end) into its blocks, then seals [0, end)."""
    pshape = c.p.shape
    ids = c.p_ids if blocks is None else blocks
    bs = pshape.block_size_tokens
    for r in c.p.ranks:
        write_shard(r.kv, g, c.p.model, pshape, r.tp_rank, r.pp_rank,
                    ids[start // bs:-(-end // bs)], first_token=start)
    sealed = end if complete else end // bs * bs
    pc.seal(c.p.engine_id, c.rid, ids[:-(-sealed // bs)] if complete else ids[:sealed // bs],
            num_tokens=sealed, generation=generation, complete=complete, consumers=consumers)


def check_bytes(c: Case, g) -> tuple[int, int]:
    mismatches = stray = 0
    for r in c.d.ranks:
        mismatches += check_shard(r.kv, g, c.d.model, c.d.shape, r.tp_rank, r.pp_rank, c.d_ids,
                                  first_token=c.skip)
        stray += untouched_blocks_nonzero(r.kv, c.d.shape, c.d_ids)
    return mismatches, stray


def ranges_read(dc: KvdClient, rid: str) -> int:
    return sum(1 for p in dc.status().finished_pulls if p.request_id.startswith(rid + "~~p"))


def run_progressive(pc, dc, paddr, m, pshape, dshape, tokens, chunk, skip=0):
    c = start_case(pc, dc, paddr, m, pshape, dshape, tokens, skip)
    try:
        g = global_kv(m, tokens, seed=3)
        time.sleep(0.2)  # the pull waits at the producer: nothing sealed yet
        assert dc.status().pulls == [], "a range was pulled before anything was sealed"
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            compute(pc, c, g, start, end, complete=end == tokens)
            time.sleep(0.05)
        recv = dc.wait(c.d.engine_id, c.rid, "done_recving", timeout_s=30)
        sent = pc.wait(c.p.engine_id, c.rid, "done_sending", timeout_s=30)
        assert recv.ok, recv.error
        assert recv.nbytes > 0 and recv.invalid_block_ids == []
        assert sent.ok, sent.error
        assert check_bytes(c, g) == (0, 0)
        return c, ranges_read(dc, c.rid)
    finally:
        deregister_and_check_freed(pc, c.p)
        deregister_and_check_freed(dc, c.d)


CASES = {
    # (prefill shape, decode shape, tokens, chunk tokens, decode prefix hit)
    "same-blocks": (shape(1), shape(1), 300, 64, 0),
    "decode-blocks-smaller": (shape(1, bs=32), shape(1, bs=16), 300, 96, 0),
    "decode-blocks-larger-tp2-to-tp1": (shape(2, bs=16), shape(1, bs=32), 300, 64, 0),
    "decode-prefix-hit": (shape(1), shape(1), 300, 64, 64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_progressive_pull_is_byte_exact_over_nixl(pair, case: str) -> None:
    pshape, dshape, tokens, chunk, skip = CASES[case]
    _, ranges = run_progressive(pair.pc, pair.dc, pair.prefill.peer_address, MODEL, pshape,
                                dshape, tokens, chunk, skip)
    assert ranges >= 2, "the sealed ranges were not read as they came"


def test_an_unseal_reads_everything_again_never_mixed(pair) -> None:
    """Preemption: generation 0 sealed half the prompt in blocks A (with bytes that turn
    out wrong), the decode read it; generation 1 computes it again into blocks B."""
    pc, dc = pair.pc, pair.dc
    c = start_case(pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), 256)
    try:
        wrong = global_kv(MODEL, 256, seed=9)
        right = global_kv(MODEL, 256, seed=3)
        compute(pc, c, wrong, 0, 128)
        wait_until(lambda: ranges_read(dc, c.rid) >= 1, 10, what="the first range read")
        moved = [b for b in range(c.p.shape.num_blocks) if b not in c.p_ids][:len(c.p_ids)]
        pc.seal(c.p.engine_id, c.rid, [], num_tokens=0, generation=1)  # unsealed
        compute(pc, c, right, 0, 128, blocks=moved, generation=1)
        compute(pc, c, right, 128, 256, blocks=moved, generation=1, complete=True)
        recv = dc.wait(c.d.engine_id, c.rid, "done_recving", timeout_s=30)
        assert recv.ok, recv.error
        assert check_bytes(c, right) == (0, 0), "bytes of the unsealed generation remain"
        assert pc.wait(c.p.engine_id, c.rid, "done_sending", timeout_s=30).ok
        assert ranges_read(dc, c.rid) >= 2
    finally:
        deregister_and_check_freed(pc, c.p)
        deregister_and_check_freed(dc, c.d)


def _fails_whole(dc: KvdClient, c: Case, *words: str, timeout_s: float = 30.0):
    recv = dc.wait(c.d.engine_id, c.rid, "done_recving", timeout_s=timeout_s)
    assert not recv.ok and recv.nbytes == 0
    assert sorted(recv.invalid_block_ids) == sorted(c.d_ids)
    assert any(w in recv.error for w in words), recv.error
    assert dc.status().pulls == [], "a range pull outlived its progressive pull"
    return recv


def test_the_producer_engine_aborts(pair) -> None:
    pc, dc = pair.pc, pair.dc
    c = start_case(pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), 256)
    try:
        compute(pc, c, global_kv(MODEL, 256), 0, 128)
        pc.abort_seal(c.p.engine_id, c.rid)
        _fails_whole(dc, c, "aborted")
        assert not pc.wait(c.p.engine_id, c.rid, "done_sending", timeout_s=10).ok
    finally:
        deregister_and_check_freed(pc, c.p)
        deregister_and_check_freed(dc, c.d)


def test_the_decode_engine_cancels(pair) -> None:
    pc, dc = pair.pc, pair.dc
    c = start_case(pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), 256)
    try:
        compute(pc, c, global_kv(MODEL, 256), 0, 128)
        dc.cancel_pull(c.d.engine_id, c.rid)
        _fails_whole(dc, c, "cancelled")
        sent = pc.wait(c.p.engine_id, c.rid, "done_sending", timeout_s=10)
        assert not sent.ok  # released at once: its one consumer abandoned it
    finally:
        deregister_and_check_freed(pc, c.p)
        deregister_and_check_freed(dc, c.d)


def test_nothing_sealed_within_the_hold_timeout(pair) -> None:
    pc, dc = pair.pc, pair.dc
    c = start_case(pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), 256,
                   hold_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        _fails_whole(dc, c, "timeout", timeout_s=10)
        assert time.monotonic() - t0 < 5
        # the prefill comes late: its hold ends at once (its one consumer gave up), the
        # engine hears done_sending now, not a lease later
        time.sleep(0.3)  # the Abandon is on its way
        t1 = time.monotonic()
        compute(pc, c, global_kv(MODEL, 256), 0, 128)
        sent = pc.wait(c.p.engine_id, c.rid, "done_sending", timeout_s=10)
        assert not sent.ok and time.monotonic() - t1 < 2
    finally:
        deregister_and_check_freed(pc, c.p)
        deregister_and_check_freed(dc, c.d)


def test_the_producer_engine_leaves_mid_prompt(pair) -> None:
    pc, dc = pair.pc, pair.dc
    c = start_case(pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), 256)
    try:
        compute(pc, c, global_kv(MODEL, 256), 0, 128)
        wait_until(lambda: ranges_read(dc, c.rid) >= 1, 10, what="the first range read")
        for r in c.p.ranks:
            pc.deregister(r)
        c.p.ranks.clear()
        _fails_whole(dc, c, "left", "ended")
    finally:
        deregister_and_check_freed(dc, c.d)


def test_two_consumers_of_one_request(pair) -> None:
    pc, dc = pair.pc, pair.dc
    tokens = 256
    c1 = start_case(pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), tokens)
    d2 = register(dc, "dec2", MODEL, shape(1))
    d2_ids = random.Random(5).sample(range(40), tokens // 16)
    dc.progressive_pull(d2.engine_id, c1.rid, c1.p.engine_id, pair.prefill.peer_address,
                        d2_ids, num_tokens=tokens)
    c2 = Case(c1.p, d2, c1.rid, c1.p_ids, d2_ids, tokens, 0)
    try:
        g = global_kv(MODEL, tokens, seed=3)
        compute(pc, c1, g, 0, 128, consumers=2)
        compute(pc, c1, g, 128, 256, complete=True, consumers=2)
        for c in (c1, c2):
            recv = dc.wait(c.d.engine_id, c.rid, "done_recving", timeout_s=30)
            assert recv.ok, recv.error
            assert check_bytes(c, g) == (0, 0)
        assert pc.wait(c1.p.engine_id, c1.rid, "done_sending", timeout_s=30).ok
    finally:
        deregister_and_check_freed(pc, c1.p)
        deregister_and_check_freed(dc, c1.d, d2)


# ------------------------------------------------------------------ the producer's daemon


@pytest.fixture
def victim(tmp_path) -> Iterator[DaemonProcess]:
    """A producer daemon of its own, for one test to kill or freeze."""
    d = start_daemon(tmp_path, "victim", DAEMON_ARGS)
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
            stop_and_check_clean(d)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_the_producer_daemon_dies_or_freezes_mid_prompt(pair, victim, how: str) -> None:
    dc = pair.dc
    with victim.client() as vc:
        c = start_case(vc, dc, victim.peer_address, MODEL, shape(1), shape(1), 256)
        try:
            compute(vc, c, global_kv(MODEL, 256), 0, 128)
            wait_until(lambda: ranges_read(dc, c.rid) >= 1, 10, what="the first range read")
            if how == "kill":
                victim.proc.kill()
                victim.proc.wait()
            else:
                victim.proc.send_signal(signal.SIGSTOP)
            _fails_whole(dc, c, "peer_lost", "timeout")
        finally:
            if how == "stop":
                victim.proc.send_signal(signal.SIGCONT)
            deregister_and_check_freed(dc, c.d)
    # the decode daemon keeps serving: a fresh progressive pull from the module's producer
    run_progressive(pair.pc, dc, pair.prefill.peer_address, MODEL, shape(1), shape(1), 128, 64)


# ------------------------------------------------------------------ the same-host copy


@pytest.fixture(scope="module")
def hostpair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, ...]]:
    """Two daemons on this host with host pulls on: the decode's daemon maps the
    producer's pool files and copies."""
    logs = tmp_path_factory.mktemp("kvd-host")
    p = start_daemon(logs, "hp", HOST)
    try:
        d = start_daemon(logs, "hd", HOST)
    except BaseException:
        stop_and_check_clean(p)
        raise
    try:
        yield p, d
    finally:
        stop_and_check_clean(d)
        stop_and_check_clean(p)


def test_progressive_pull_is_byte_exact_on_the_host_path(hostpair) -> None:
    p, d = hostpair
    with p.client() as pc, d.client() as dc:
        _, ranges = run_progressive(pc, dc, p.peer_address, MODEL, shape(1), shape(1), 300,
                                    64)
        assert ranges >= 2
        assert {f.path for f in dc.status().finished_pulls} == {"host"}


# ------------------------------------------------------------------ one daemon: the copy


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, KvdClient]]:
    d = start_daemon(tmp_path_factory.mktemp("kvd-logs"), "one")
    c = d.client()
    try:
        yield d, c
    finally:
        c.close()
        stop_and_check_clean(d)


@pytest.mark.parametrize("case", ["same-blocks", "decode-blocks-smaller"])
def test_progressive_pull_is_byte_exact_on_one_daemon(one, case: str) -> None:
    d, c = one
    pshape, dshape, tokens, chunk, skip = CASES[case]
    _, ranges = run_progressive(c, c, d.peer_address, MODEL, pshape, dshape, tokens, chunk,
                                skip)
    assert ranges >= 2
    assert all(p.path == "local" for p in c.status().finished_pulls)

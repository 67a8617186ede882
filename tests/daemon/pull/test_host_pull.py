"""Two daemons on one host (one sidecar per engine pod): a pull between them maps the
producer's pool files and copies (path "host"), with the control messages still going
to the producer daemon over the network, so its hold is released only by the READ
notice sent once the copy ended. Real ``kvd serve`` processes sharing /dev/shm; bytes
checked. Pools without a file (memfd) fall back to NIXL READs, and ``kvd status``
says why.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support.cluster import (
    Pair,
    deregister_and_check_freed,
    metric,
    pools_of,
    register,
    run_transfer,
    running_pair,
    unique,
    wait_until,
)
from support.matrix_cases import CASES, model, shape

from kvd.errors import KvdTimeoutError
from kvd.ops.status import format_status
from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

HOST = ["--set", "host_pulls=true"]  # the suite's default is off (tests/conftest.py)
BIG = ModelSpec(name="host-big", num_kv_heads=8, num_layers=32, head_dim=128)  # 2 MiB/block


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with running_pair(tmp_path_factory.mktemp("kvd-logs"), HOST) as p:
        yield p


def _mapped(pid: int, names: list[str]) -> list[str]:
    """Lines of the process's memory map naming one of these pool files."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in maps if any(n in line for n in names)]


@pytest.mark.parametrize("case", ["tp1-tp1", "decode-tp-larger-1-2", "prefill-tp-larger-4-2",
                                  "mla-2-3", "block-ratio-16-32-prefix-hit"])
def test_a_pull_between_two_daemons_of_one_host_takes_the_host_path(two, case) -> None:
    p = two
    m, pshape, dshape, tokens, skip = ((model(), shape(1), shape(1), 256, 0)
                                       if case == "tp1-tp1" else CASES[case])
    host0 = metric(p.decode, "kvd_transfers_total", role="consumer", path="host")
    remote0 = metric(p.decode, "kvd_transfers_total", role="consumer", path="remote")
    res = run_transfer(p.prefill, p.decode, p.pc, p.dc, m, pshape, dshape, tokens,
                       skip_tokens=skip)
    assert res.recv.ok, res.recv.error
    assert res.mismatches == 0 and res.stray == 0
    assert res.sent.ok and res.sent.nbytes == res.recv.nbytes  # released by our notice
    assert metric(p.decode, "kvd_transfers_total", role="consumer", path="host") == host0 + 1
    assert metric(p.decode, "kvd_transfers_total", role="consumer",
                  path="remote") == remote0
    finished = [f for f in p.dc.status().finished_pulls if f.request_id == res.recv.request_id]
    assert [f.path for f in finished] == ["host"]


def _pull_and_status(p: Pair, m: ModelSpec = model()):
    """One small pull, engines still registered: the consumer daemon's status then."""
    pe, de = register(p.pc, "sp", m, shape(1)), register(p.dc, "sd", m, shape(1))
    try:
        rid = unique("st")
        p.pc.publish(pe.engine_id, rid, [1, 2])
        p.dc.pull(de.engine_id, rid, pe.engine_id, p.prefill.peer_address, [1, 2], [3, 4])
        assert p.dc.wait(de.engine_id, rid, "done_recving", timeout_s=30).ok
        return p.dc.status()
    finally:
        deregister_and_check_freed(p.pc, pe)
        deregister_and_check_freed(p.dc, de)


def test_status_says_which_path_a_peer_takes_and_why(two) -> None:
    st = _pull_and_status(two)
    assert st.peers and {x.path for x in st.peers} == {"host"}, st.peers
    assert all("same host" in x.why for x in st.peers), st.peers
    assert "path host (same host" in format_status(st)


def _big(c, prefix: str, blocks: int):
    shape_ = EngineShape(tp_size=1, num_blocks=blocks)
    return shape_, register(c, prefix, BIG, shape_)


def test_the_hold_is_released_only_after_the_copy(two) -> None:
    """192 MiB pulls; the consumer daemon is frozen (SIGSTOP) right after it accepted
    each: while it is frozen (its copy not ended) the producer keeps holding the
    request, however long; thawed, the copy ends, byte-exact, and only then does the
    producer release it, counting the bytes of the consumer's notice."""
    p = two
    _, pe = _big(p.pc, "bigp", 96)
    _, de = _big(p.dc, "bigd", 96)
    caught = 0
    try:
        words = pe.ranks[0].kv.view(np.uint64).reshape(-1)
        words[:] = np.arange(words.size, dtype=np.uint64)
        rng = random.Random(5)
        for attempt in range(3):
            p_ids, d_ids = rng.sample(range(96), 96), rng.sample(range(96), 96)
            de.ranks[0].kv[:] = 0
            rid = unique(f"hold{attempt}")
            p.pc.publish(pe.engine_id, rid, p_ids)
            p.dc.pull(de.engine_id, rid, pe.engine_id, p.prefill.peer_address, p_ids, d_ids)
            os.kill(p.decode.proc.pid, signal.SIGSTOP)
            try:
                if [h for h in p.pc.status().held if h.request_id == rid]:
                    caught += 1  # frozen before its copy ended: the hold must stay
                    time.sleep(1.0)
                    assert [h for h in p.pc.status().held if h.request_id == rid]
                    with pytest.raises(KvdTimeoutError):
                        p.pc.wait(pe.engine_id, rid, "done_sending", timeout_s=0.2)
            finally:
                os.kill(p.decode.proc.pid, signal.SIGCONT)
            recv = p.dc.wait(de.engine_id, rid, "done_recving", timeout_s=30)
            sent = p.pc.wait(pe.engine_id, rid, "done_sending", timeout_s=30)
            assert recv.ok and sent.ok and sent.nbytes == recv.nbytes, (recv, sent)
            assert np.array_equal(de.ranks[0].kv[:, :, d_ids], pe.ranks[0].kv[:, :, p_ids])
            finished = [f.path for f in p.dc.status().finished_pulls if f.request_id == rid]
            assert finished == ["host"]
        assert caught, "the consumer daemon was never frozen before its copy ended"
    finally:
        deregister_and_check_freed(p.pc, pe)
        deregister_and_check_freed(p.dc, de)


def test_the_producer_leaving_mid_copy_loses_nothing_and_unmaps(two) -> None:
    """The producer engine deregisters right after the pull is accepted: the pull ends
    ok with the right bytes or names every block invalid; the producer's pool is freed
    (unlinked), and the consumer daemon does not keep it mapped once the pull ended."""
    p = two
    shape_, pe = _big(p.pc, "leavep", 96)
    _, de = _big(p.dc, "leaved", 96)
    words = pe.ranks[0].kv.view(np.uint64).reshape(-1)
    words[:] = np.arange(words.size, dtype=np.uint64)
    rng = random.Random(9)
    p_ids, d_ids = rng.sample(range(96), 96), rng.sample(range(96), 96)
    expected = pe.ranks[0].kv[:, :, p_ids].copy()
    # A first pull maps the pool (the handshake); the second is the one interrupted.
    warm = unique("warm")
    p.pc.publish(pe.engine_id, warm, p_ids[:2])
    p.dc.pull(de.engine_id, warm, pe.engine_id, p.prefill.peer_address, p_ids[:2], d_ids[:2])
    assert p.dc.wait(de.engine_id, warm, "done_recving", timeout_s=30).ok
    pools = pools_of(p.pc, {pe.engine_id})
    assert _mapped(p.decode.proc.pid, pools), "the producer's pool is not mapped"
    rid = unique("leave")
    p.pc.publish(pe.engine_id, rid, p_ids)
    p.dc.pull(de.engine_id, rid, pe.engine_id, p.prefill.peer_address, p_ids, d_ids)
    for r in pe.ranks:
        p.pc.deregister(r)
    recv = p.dc.wait(de.engine_id, rid, "done_recving", timeout_s=30)
    if recv.ok:
        assert np.array_equal(de.ranks[0].kv[:, :, d_ids], expected)
    else:
        assert recv.invalid_block_ids == d_ids and recv.nbytes == 0
    wait_until(lambda: not pools_of(p.pc, {pe.engine_id}), 10, what="producer freed")
    wait_until(lambda: not _mapped(p.decode.proc.pid, pools), 10,
               what="the freed pool unmapped by the consumer daemon")
    deregister_and_check_freed(p.dc, de)


def test_memfd_pools_go_over_the_network_and_status_says_why(tmp_path) -> None:
    with running_pair(tmp_path, HOST + ["--set", "pool_backing=memfd"]) as p:
        res = run_transfer(p.prefill, p.decode, p.pc, p.dc, model(), shape(2), shape(1), 128)
        assert res.recv.ok and res.mismatches == 0 and res.sent.ok
        finished = [f for f in p.dc.status().finished_pulls
                    if f.request_id == res.recv.request_id]
        assert [f.path for f in finished] == ["remote"]
        assert metric(p.decode, "kvd_transfers_total", role="consumer", path="host") == 0
        st = _pull_and_status(p)
        assert st.peers and {x.path for x in st.peers} == {"remote"}
        assert all("memfd" in x.why for x in st.peers), st.peers
        assert "path remote (same host, but rank" in format_status(st)


@pytest.mark.parametrize("case", ["tp4-tp1", "tp1-tp4", "pp2-tp2-prefix-hit"])
def test_a_hybrid_pull_takes_the_host_path(two, case: str) -> None:
    """Every KV-cache group and the Mamba state, read from the mapped pool files."""
    from support.hybrid_cases import CASES as HYBRID_CASES
    from support.hybrid_cases import run_hybrid, spec

    p = two
    pshape, dshape, tokens, skip = HYBRID_CASES[case]
    host0 = metric(p.decode, "kvd_transfers_total", role="consumer", path="host")
    recv, sent, bad = run_hybrid(p, spec(), pshape, dshape, tokens, skip)
    assert recv.ok and sent.ok, (recv, sent)
    assert bad == 0, f"{bad} decode elements differ from the expected pools"
    assert metric(p.decode, "kvd_transfers_total", role="consumer", path="host") == host0 + 1

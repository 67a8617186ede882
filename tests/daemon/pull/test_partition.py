"""A partition mid-pull never writes into memory kvd has handed back.

The decode node's link is cut at a point of a pull (before its first byte, in the
middle, near its last byte) and brought back after the failure is reported. The moment
``done_recving ok=False`` arrives the decode engine reuses its whole pool (every byte
set to a marker) and the prefill engine, once released, refills its pool; after the
heal every byte of the decode's pool must still be the marker: 0 late bytes. A new pull
then works without a restart.

``KVD_MULTINODE_REPEAT=10`` runs every cut point and frozen-producer rule that many times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from support.multinode.harness import AgentError, Cluster

pytestmark = [pytest.mark.nixl, pytest.mark.multinode]

MODEL = {"name": "mnp", "num_kv_heads": 4, "num_layers": 8, "head_dim": 64}
BLOCK_BYTES = 4 * 8 * 2 * 16 * 64 * 2  # 128 KiB
NUM_BLOCKS = 160
PULL_BLOCKS = 128  # 16 MiB: ~1.4 s at 100 Mbit/s
RATE_MBIT = 100
# A partition or a dead/frozen peer is noticed within peer_liveness_timeout_s
# (default 3 s) and the engine hears of it within one more poll; POLL_MARGIN_S is that
# poll plus scheduling on a loaded 2-core machine.
LIVENESS_S = 3.0
POLL_MARGIN_S = 0.5
DETECT_BUDGET_S = LIVENESS_S + POLL_MARGIN_S
# Heartbeats renew it while the READ runs; after a failed pull whose Abandon was lost in
# the partition, the producer releases at lease end: short, to keep the case short.
LEASE_S = 6.0
MARK_DECODE, MARK_PREFILL = 0x5A, 0xA5
REPEAT = int(os.environ.get("KVD_MULTINODE_REPEAT", "1"))
# handshake_timeout_s at its default (5 s): a cut before the first byte catches the pull
# in its handshake, which liveness must fail within peer_liveness_timeout_s, not 5 s.
ARGS = ["--set", "heartbeat_interval_s=0.5", "--set", "handshake_timeout_s=5"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(2, tmp_path_factory.mktemp("mnpart")) as c:
        for node in c.nodes:
            node.start_daemon(args=ARGS)
        c.shape(1, RATE_MBIT)
        yield c


def _cut_when(c: Cluster, point: str, before: int, start_s: float) -> None:
    total = PULL_BLOCKS * BLOCK_BYTES
    target = {"mid": 0.4, "late": 0.97}[point] * total
    while c.link_bytes(1) - before < target:
        if time.monotonic() - start_s > 30:
            raise AssertionError(f"pull never reached {point}")
        time.sleep(0.002)
    c.cut(1)


# UCX 1.23 (nixl-cu12 1.5.1): when a producer's endpoint to a consumer fails
# while software-emulated GET replies (UCX over TCP) wait in its pending queue,
# ucp_worker_discard_uct_ep -> uct_tcp_ep_pending_purge -> ucp_request_send_state_ff
# deregisters memory by the reply request's never-set datatype: SIGSEGV at libucp
# +0x4e18d when the pool's recycled bytes read as an IOV. kvd.transport.remote.ucx_heap makes
# malloc hand UCX zeroed memory (docs/reliability.md), which makes it rare, not gone: a
# crash inside NIXL's Python API (faulthandler's dump names the frame) is reported xfail,
# any other crash fails the test.
KNOWN_UCX_CRASH = "nixl_cu12/_api.py"


def _revive(c: Cluster) -> None:
    """A daemon a previous case saw crash (and reported) runs again for this one."""
    for node in c.nodes:
        if not node.call("alive", name="kvd"):
            node.call("restart_daemon", name="kvd")


def _assert_alive(c: Cluster) -> None:
    """A daemon that crashed fails the test (its log has faulthandler's
    stacks); it is restarted first, so that the next cases run."""
    for node in c.nodes:
        rc = node.call("returncode", name="kvd")
        if rc is None:
            continue
        site = node.call("crash_site", name="kvd")
        node.call("restart_daemon", name="kvd")
        if rc in (-11, -6) and KNOWN_UCX_CRASH in site:
            # The upstream UCX bug (a purged GET reply; rarer with kvd.transport.remote.ucx_heap,
            # 0/60 frozen cases and 2/102 repro rounds, not gone): reported, never passed,
            # and not a reason to fail every unrelated change in CI.
            pytest.xfail(f"node {node.index}'s daemon hit the UCX 1.23 pending GET reply "
                         f"purge in a NIXL call (rc {rc}; {site}) despite the zeroed heap")
        pytest.fail(f"node {node.index}'s daemon died (rc {rc}) at {site!r}; see its log")


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("point", ["before", "mid", "late"])
def test_partition_never_writes_late_and_recovers(nodes: Cluster, point: str, rep: int) -> None:
    prefill, decode = nodes.nodes
    _revive(nodes)
    tag = f"{point}{rep}"
    pe, de = f"pre-{tag}", f"dec-{tag}"
    prefill.call("register", daemon="kvd", engine_id=pe, model=MODEL, tp_size=1,
                 num_blocks=NUM_BLOCKS)
    decode.call("register", daemon="kvd", engine_id=de, model=MODEL, tp_size=1,
                num_blocks=NUM_BLOCKS)
    tokens = PULL_BLOCKS * 16
    ids = list(range(PULL_BLOCKS))
    prefill.call("write", engine_id=pe, block_ids=ids, tokens=tokens, seed=11)
    prefill.call("publish", engine_id=pe, request_id=tag, block_ids=ids, lease_s=LEASE_S)
    before = nodes.link_bytes(1)
    healed = False
    try:
        if point == "before":
            nodes.cut(1)
        start_s = time.monotonic()
        decode.call("pull", engine_id=de, request_id=tag, remote_engine_id=pe,
                    remote_address=prefill.peer_address, remote_block_ids=ids,
                    local_block_ids=ids, num_tokens=tokens)
        if point != "before":
            _cut_when(nodes, point, before, start_s)
        cut_s = time.monotonic()
        recv = decode.call("wait", engine_id=de, request_id=tag, kind="done_recving",
                           timeout_s=60)
        detect_s = time.monotonic() - cut_s
        if recv["ok"]:  # the last bytes were in before the cut: nothing to protect
            assert decode.call("check", engine_id=de, block_ids=ids, tokens=tokens,
                               seed=11) == 0
            return
        # The engine reuses every block it got back, at once.
        decode.call("fill", engine_id=de, byte=MARK_DECODE)
        print(f"{point}: failure reported {detect_s:.2f}s after the cut: {recv}")
        nodes.heal(1)
        healed = True
        sent: object = "producer daemon crashed"
        try:  # released on the Abandon after the heal, or at lease end
            sent = prefill.call("wait", engine_id=pe, request_id=tag, kind="done_sending",
                                timeout_s=LEASE_S + 10)
            prefill.call("fill", engine_id=pe, byte=MARK_PREFILL)  # refilled once released
        except AgentError:
            if prefill.call("alive", name="kvd"):
                raise
        time.sleep(3.0)  # anything the transport still had would have landed by now
        late = decode.call("count_not", engine_id=de, byte=MARK_DECODE)
        assert late == 0, f"{late} bytes written after the failure was reported ({sent})"
        assert detect_s <= DETECT_BUDGET_S, f"failure took {detect_s:.1f}s to report"
    finally:
        if not healed:
            nodes.heal(1)
    _assert_alive(nodes)
    # Recovery: a new pull works, without restarting the decode daemon.
    prefill.call("write", engine_id=pe, block_ids=ids[:8], tokens=8 * 16, seed=12)
    prefill.call("publish", engine_id=pe, request_id=tag + "-again", block_ids=ids[:8])
    decode.call("pull", engine_id=de, request_id=tag + "-again", remote_engine_id=pe,
                remote_address=prefill.peer_address, remote_block_ids=ids[:8],
                local_block_ids=ids[:8], num_tokens=8 * 16)
    again = decode.call("wait", engine_id=de, request_id=tag + "-again", kind="done_recving",
                        timeout_s=30)
    assert again["ok"], again
    assert decode.call("check", engine_id=de, block_ids=ids[:8], tokens=8 * 16, seed=12) == 0


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("rule", ["liveness", "deadline"])
def test_a_frozen_producer_never_writes_late(nodes: Cluster, rule: str, rep: int) -> None:
    """A producer daemon frozen (SIGSTOP) mid-READ keeps its TCP connections (the kernel
    still acknowledges) and its READ would resume when it wakes (NIXL PR #2047: a READ
    stuck in progress). ``liveness``: the consumer's ZMTP heartbeats lose it within
    peer_liveness_timeout_s; ``deadline``: liveness is set long, and transfer_timeout_s
    (2 s) ends the pull. Either way kvd severs the READ's connections, reports the pull
    failed only once the transport failed the READ, and after the producer wakes no byte
    lands in the decode's pool; the producer then serves a new pull."""
    prefill, decode = nodes.nodes
    _revive(nodes)
    deadline_s = 2.0
    if rule == "deadline":
        decode.call("replace_daemon", name="kvd", args=ARGS + [
            "--set", f"transfer_timeout_s={deadline_s}", "--set", "peer_liveness_timeout_s=30",
            "--set", "lease_s=60"])  # a lease must outlast a heartbeat and the liveness timeout
    pe, de = f"pre-frz-{rule}{rep}", f"dec-frz-{rule}{rep}"
    prefill.call("register", daemon="kvd", engine_id=pe, model=MODEL, tp_size=1,
                 num_blocks=NUM_BLOCKS)
    decode.call("register", daemon="kvd", engine_id=de, model=MODEL, tp_size=1,
                num_blocks=NUM_BLOCKS)
    tokens, ids = PULL_BLOCKS * 16, list(range(PULL_BLOCKS))
    prefill.call("write", engine_id=pe, block_ids=ids, tokens=tokens, seed=21)
    prefill.call("publish", engine_id=pe, request_id=f"frz{rep}", block_ids=ids, lease_s=LEASE_S)
    before = nodes.link_bytes(1)
    frozen = False
    try:
        start_s = time.monotonic()
        decode.call("pull", engine_id=de, request_id=f"frz{rep}", remote_engine_id=pe,
                    remote_address=prefill.peer_address, remote_block_ids=ids,
                    local_block_ids=ids, num_tokens=tokens)
        while nodes.link_bytes(1) - before < 0.4 * PULL_BLOCKS * BLOCK_BYTES:
            assert time.monotonic() - start_s < 30, "the pull never got going"
            time.sleep(0.002)
        prefill.call("signal_daemon", name="kvd", sig="SIGSTOP")
        frozen, freeze_s = True, time.monotonic()
        recv = decode.call("wait", engine_id=de, request_id=f"frz{rep}", kind="done_recving",
                           timeout_s=60)
        detect_s = recv["at"] - freeze_s
        assert not recv["ok"], "the frozen producer's READ completed"
        decode.call("fill", engine_id=de, byte=MARK_DECODE)  # the engine reuses its blocks
        print(f"frozen producer ({rule}): failure reported {detect_s:.2f}s after the freeze, "
              f"{recv['at'] - start_s:.2f}s after the pull: {recv['error']}")
        prefill.call("signal_daemon", name="kvd", sig="SIGCONT")
        frozen = False
        time.sleep(3.0)  # a resumed READ would have landed by now
        late = decode.call("count_not", engine_id=de, byte=MARK_DECODE)
        assert late == 0, f"{late} bytes written after the failure was reported"
        if rule == "liveness":
            assert recv["error"].startswith("peer_lost"), recv["error"]
            assert detect_s <= DETECT_BUDGET_S, f"took {detect_s:.2f}s (budget {DETECT_BUDGET_S})"
        else:
            assert recv["error"].startswith("timeout"), recv["error"]
            assert recv["at"] - start_s <= deadline_s + POLL_MARGIN_S, recv
        _assert_alive(nodes)
        # The producer, awake again, serves a new pull.
        prefill.call("write", engine_id=pe, block_ids=ids[:8], tokens=8 * 16, seed=22)
        prefill.call("publish", engine_id=pe, request_id=f"frz{rep}-again", block_ids=ids[:8])
        decode.call("pull", engine_id=de, request_id=f"frz{rep}-again", remote_engine_id=pe,
                    remote_address=prefill.peer_address, remote_block_ids=ids[:8],
                    local_block_ids=ids[:8], num_tokens=8 * 16)
        again = decode.call("wait", engine_id=de, request_id=f"frz{rep}-again", kind="done_recving",
                            timeout_s=30)
        assert again["ok"], again["error"]
        assert decode.call("check", engine_id=de, block_ids=ids[:8], tokens=8 * 16,
                           seed=22) == 0
    finally:
        if frozen:
            prefill.call("signal_daemon", name="kvd", sig="SIGCONT")
        if rule == "deadline":
            decode.call("replace_daemon", name="kvd", args=ARGS)

"""Two rails (issue 23): two daemons in separate namespaces joined by two veth pairs,
``rails=eth0,eth1``; a large pull is byte-exact and moves bytes over both links, as the
switch ports' counters show, and each rail's bytes are in ``kvd status``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import Cluster

pytestmark = pytest.mark.nixl

MODEL = {"name": "rails", "num_kv_heads": 8, "num_layers": 8, "head_dim": 128}
BLOCK_BYTES = 8 * 8 * 2 * 16 * 128 * 2  # heads * layers * kv * tokens * dim * bf16: 512 KiB
NUM_BLOCKS = 160
RAILS = ["--set", "rails=eth0,eth1"]


@pytest.fixture(scope="module")
def two_rails(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(2, tmp_path_factory.mktemp("rails"), rails=2) as c:
        for node in c.nodes:
            node.start_daemon(args=RAILS)
        yield c


def _pull(c: Cluster, tag: str, ptp: int, dtp: int, n: int) -> None:
    prefill, decode = c.nodes
    pe, de = f"pre{tag}", f"dec{tag}"
    prefill.call("register", daemon="kvd", engine_id=pe, model=MODEL, tp_size=ptp,
                 num_blocks=NUM_BLOCKS)
    decode.call("register", daemon="kvd", engine_id=de, model=MODEL, tp_size=dtp,
                num_blocks=NUM_BLOCKS)
    tokens = n * 16
    p_ids = list(range(3, 3 + 2 * n, 2))  # fragmented: every other block
    d_ids = list(range(NUM_BLOCKS - n, NUM_BLOCKS))[::-1]
    prefill.call("write", engine_id=pe, block_ids=p_ids, tokens=tokens, seed=5)
    prefill.call("publish", engine_id=pe, request_id=f"r{tag}", block_ids=p_ids)
    decode.call("pull", engine_id=de, request_id=f"r{tag}", remote_engine_id=pe,
                remote_address=prefill.peer_address, remote_block_ids=p_ids,
                local_block_ids=d_ids, num_tokens=tokens)
    recv = decode.call("wait", engine_id=de, request_id=f"r{tag}", kind="done_recving",
                       timeout_s=60)
    sent = prefill.call("wait", engine_id=pe, request_id=f"r{tag}", kind="done_sending",
                        timeout_s=60)
    assert recv["ok"] and sent["ok"], (recv, sent)
    assert recv["nbytes"] == n * BLOCK_BYTES
    assert decode.call("check", engine_id=de, block_ids=d_ids, tokens=tokens, seed=5) == 0


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (2, 1)])
def test_large_pull_moves_bytes_over_both_rails(two_rails: Cluster, ptp: int, dtp: int
                                               ) -> None:
    c = two_rails
    decode = c.nodes[1]
    n = 64  # 32 MiB: split in two 16 MiB parts, one per rail
    before = [c.link_bytes(decode.index, rail) for rail in (0, 1)]
    stats_before = {r["rail"]: r["nbytes"] for r in decode.call("status", name="kvd")["rails"]}
    _pull(c, f"{ptp}{dtp}", ptp, dtp, n)
    crossed = [c.link_bytes(decode.index, rail) - b for rail, b in zip((0, 1), before,
                                                                       strict=True)]
    total = n * BLOCK_BYTES
    print(f"\n{total >> 20} MiB pull TP{ptp}->TP{dtp}: rail 0 {crossed[0] >> 20} MiB, "
          f"rail 1 {crossed[1] >> 20} MiB through the decode node's switch ports")
    assert sum(crossed) >= total, crossed
    for rail in (0, 1):  # each rail carried a fair share, not a trickle
        assert crossed[rail] >= total // 4, f"rail {rail} moved only {crossed}"
    after = {r["rail"]: r["nbytes"] for r in decode.call("status", name="kvd")["rails"]}
    assert set(after) == {"", "eth0", "eth1"}
    for rail in ("eth0", "eth1"):
        assert after[rail] - stats_before.get(rail, 0) >= total // 4, (stats_before, after)


def test_small_pull_stays_on_the_daemons_agent(two_rails: Cluster) -> None:
    decode = two_rails.nodes[1]
    before = {r["rail"]: r["reads"] for r in decode.call("status", name="kvd")["rails"]}
    _pull(two_rails, "small", 1, 1, 2)
    after = {r["rail"]: r["reads"] for r in decode.call("status", name="kvd")["rails"]}
    assert after[""] == before[""] + 1
    assert after["eth0"] == before["eth0"] and after["eth1"] == before["eth1"]


def test_a_rail_the_producer_lacks_is_left_out(tmp_path_factory: pytest.TempPathFactory
                                              ) -> None:
    """The producer's node has rail 1 down (no address on it): the consumer's rail-1
    worker cannot reach it, so its share goes to the daemon's agent (every rail) and
    the pull is still byte-exact; nothing crosses rail 1."""
    import subprocess

    with Cluster(2, tmp_path_factory.mktemp("rails1"), rails=2) as c:
        prefill, decode = c.nodes
        subprocess.run(["ip", "-n", prefill.netns, "link", "set", "eth1", "down"], check=True)
        prefill.start_daemon()
        decode.start_daemon(args=RAILS)
        before = c.link_bytes(decode.index, 1)
        for i in range(2):  # the second pull no longer tries rail 1
            _pull(c, f"lack{i}", 1, 1, 64)
        assert c.link_bytes(decode.index, 1) - before < BLOCK_BYTES
        rails = {r["rail"]: r for r in decode.call("status", name="kvd")["rails"]}
        assert rails["eth1"]["reads"] == 0
        assert rails["eth0"]["reads"] >= 1  # rail 0 still carries its share

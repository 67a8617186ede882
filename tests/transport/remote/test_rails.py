"""Two rails: two daemons in separate namespaces joined by two veth pairs,
``rails=eth0,eth1``. A large pull, contiguous or fragmented, is byte-exact and each
link carries its share of the bytes (40-60 %) by the decode node's own interface
counters (/sys/class/net/eth*/statistics); each rail's bytes in ``kvd status`` agree
with those counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.multinode.harness import Cluster

pytestmark = [pytest.mark.nixl, pytest.mark.multinode]

MODEL = {"name": "rails", "num_kv_heads": 8, "num_layers": 8, "head_dim": 128}
BLOCK_BYTES = 8 * 8 * 2 * 16 * 128 * 2  # heads * layers * kv * tokens * dim * bf16: 512 KiB
NUM_BLOCKS = 520  # a fragmented 128 MiB pull (every other block) fits
RAILS = ["--set", "rails=eth0,eth1"]
# head_major: a block is one contiguous region per rank, so consecutive blocks merge into
# one descriptor (per prefill rank): the pull that went whole over one rail before its
# READ was split by bytes.
LAYOUT = "head_major"
# Interface bytes over the payload a rail's worker read: TCP/IP headers both ways (MTU
# 1500: ~4.5 %), ACKs, UCX's GET requests; a rail's pull traffic stays under this.
WIRE_OVERHEAD = 1.12


@pytest.fixture(scope="module")
def two_rails(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(2, tmp_path_factory.mktemp("rails"), rails=2) as c:
        prefill, decode = c.nodes
        for node in c.nodes:
            node.start_daemon(args=RAILS)
        for tp in (1, 2):
            prefill.call("register", daemon="kvd", engine_id=f"pre{tp}", model=MODEL,
                         tp_size=tp, num_blocks=NUM_BLOCKS, kv_layout=LAYOUT)
        decode.call("register", daemon="kvd", engine_id="dec", model=MODEL, tp_size=1,
                    num_blocks=NUM_BLOCKS, kv_layout=LAYOUT)
        yield c


def _ids(n: int, contiguous: bool) -> tuple[list[int], list[int]]:
    if contiguous:
        return list(range(3, 3 + n)), list(range(NUM_BLOCKS - n - 1, NUM_BLOCKS - 1))
    return list(range(3, 3 + 2 * n, 2)), list(range(NUM_BLOCKS - n, NUM_BLOCKS))[::-1]


def _pull(c: Cluster, tag: str, ptp: int, p_ids: list[int], d_ids: list[int],
          seed: int = 5) -> None:
    prefill, decode = c.nodes
    pe, rid = f"pre{ptp}", f"r{tag}"
    tokens = len(p_ids) * 16
    prefill.call("write", engine_id=pe, block_ids=p_ids, tokens=tokens, seed=seed)
    prefill.call("publish", engine_id=pe, request_id=rid, block_ids=p_ids)
    decode.call("pull", engine_id="dec", request_id=rid, remote_engine_id=pe,
                remote_address=prefill.peer_address, remote_block_ids=p_ids,
                local_block_ids=d_ids, num_tokens=tokens)
    recv = decode.call("wait", engine_id="dec", request_id=rid, kind="done_recving",
                       timeout_s=120)
    sent = prefill.call("wait", engine_id=pe, request_id=rid, kind="done_sending",
                        timeout_s=60)
    assert recv["ok"] and sent["ok"], (recv, sent)
    assert recv["nbytes"] == len(p_ids) * BLOCK_BYTES
    assert decode.call("check", engine_id="dec", block_ids=d_ids, tokens=tokens,
                       seed=seed) == 0


def _rails(c: Cluster) -> dict[str, int]:
    return {r["rail"]: r["nbytes"] for r in c.nodes[1].call("status", name="kvd")["rails"]}


@pytest.mark.parametrize("mib", [32, 128])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("ptp", [1, 2], ids=["tp1-tp1", "tp2-tp1"])
def test_large_pull_is_spread_over_both_links(two_rails: Cluster, ptp: int, contiguous: bool,
                                              mib: int) -> None:
    c = two_rails
    decode = c.nodes[1]
    n = mib * (1 << 20) // BLOCK_BYTES
    p_ids, d_ids = _ids(n, contiguous)
    devs = ("eth0", "eth1")
    before = [decode.call("iface_bytes", dev=d) for d in devs]
    stats_before = _rails(c)
    _pull(c, f"{ptp}-{int(contiguous)}-{mib}", ptp, p_ids, d_ids)
    crossed = [decode.call("iface_bytes", dev=d) - b for d, b in zip(devs, before, strict=True)]
    stats = {k: v - stats_before.get(k, 0) for k, v in _rails(c).items()}
    total = n * BLOCK_BYTES
    shares = [x / sum(crossed) for x in crossed]
    print(f"\n{mib} MiB {'contiguous' if contiguous else 'fragmented'} TP{ptp}->TP1: "
          f"eth0 {crossed[0] / 2**20:.1f} MiB ({shares[0]:.1%}), eth1 "
          f"{crossed[1] / 2**20:.1f} MiB ({shares[1]:.1%}); kvd status eth0 "
          f"{stats['eth0'] / 2**20:.1f} MiB, eth1 {stats['eth1'] / 2**20:.1f} MiB")
    assert sum(crossed) >= total, crossed
    for share in shares:  # each link its share, whatever the block-id pattern
        assert 0.4 <= share <= 0.6, (crossed, shares)
    # The daemon's agent (every rail) read nothing: each byte is on its worker's rail.
    assert stats[""] == 0, stats
    assert stats["eth0"] + stats["eth1"] == total, stats
    for dev, wire in zip(devs, crossed, strict=True):  # kvd status agrees with the counters
        assert stats[dev] <= wire <= stats[dev] * WIRE_OVERHEAD + (1 << 20), (dev, wire, stats)


def test_small_pull_stays_on_the_daemons_agent(two_rails: Cluster) -> None:
    decode = two_rails.nodes[1]
    before = {r["rail"]: r["reads"] for r in decode.call("status", name="kvd")["rails"]}
    _pull(two_rails, "small", 1, [7, 8], [40, 41])
    after = {r["rail"]: r["reads"] for r in decode.call("status", name="kvd")["rails"]}
    assert after[""] > before[""]  # (a READ may be repeated when the hold was young)
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
        prefill.call("register", daemon="kvd", engine_id="pre1", model=MODEL, tp_size=1,
                     num_blocks=160)
        decode.call("register", daemon="kvd", engine_id="dec", model=MODEL, tp_size=1,
                    num_blocks=160)
        before = c.link_bytes(decode.index, 1)
        for i in range(2):  # the second pull no longer tries rail 1
            _pull(c, f"lack{i}", 1, list(range(3, 131, 2)), list(range(96, 160)))
        assert c.link_bytes(decode.index, 1) - before < BLOCK_BYTES
        rails = {r["rail"]: r for r in decode.call("status", name="kvd")["rails"]}
        assert rails["eth1"]["reads"] == 0
        assert rails["eth0"]["reads"] >= 1  # rail 0 still carries its share

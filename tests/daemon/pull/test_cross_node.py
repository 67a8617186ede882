"""Pulls between simulated nodes: byte-exact, over the link, hetero TP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.multinode.harness import Cluster

pytestmark = [pytest.mark.nixl, pytest.mark.multinode]

MODEL = {"name": "mn", "num_kv_heads": 4, "num_layers": 8, "head_dim": 64}
BLOCK_BYTES = 4 * 8 * 2 * 16 * 64 * 2  # heads * layers * kv * tokens * dim * bf16: 128 KiB
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(2, tmp_path_factory.mktemp("mn2")) as c:
        for node in c.nodes:
            node.start_daemon()
        yield c


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (2, 1), (1, 2)])
def test_cross_node_pull_is_byte_exact_and_crosses_the_link(two_nodes: Cluster, ptp: int,
                                                            dtp: int) -> None:
    prefill, decode = two_nodes.nodes
    tag = f"{ptp}{dtp}"
    pe, de = f"pre{tag}", f"dec{tag}"
    prefill.call("register", daemon="kvd", engine_id=pe, model=MODEL, tp_size=ptp,
                 num_blocks=NUM_BLOCKS)
    decode.call("register", daemon="kvd", engine_id=de, model=MODEL, tp_size=dtp,
                num_blocks=NUM_BLOCKS)
    n = 64
    tokens = n * 16
    p_ids, d_ids = list(range(10, 10 + n)), list(range(NUM_BLOCKS - n, NUM_BLOCKS))[::-1]
    prefill.call("write", engine_id=pe, block_ids=p_ids, tokens=tokens, seed=7)
    before = two_nodes.link_bytes(decode.index)
    prefill.call("publish", engine_id=pe, request_id=f"r{tag}", block_ids=p_ids)
    decode.call("pull", engine_id=de, request_id=f"r{tag}", remote_engine_id=pe,
                remote_address=prefill.peer_address, remote_block_ids=p_ids,
                local_block_ids=d_ids, num_tokens=tokens)
    recv = decode.call("wait", engine_id=de, request_id=f"r{tag}", kind="done_recving",
                       timeout_s=30)
    sent = prefill.call("wait", engine_id=pe, request_id=f"r{tag}", kind="done_sending",
                        timeout_s=30)
    assert recv["ok"] and sent["ok"], (recv, sent)
    assert decode.call("check", engine_id=de, block_ids=d_ids, tokens=tokens, seed=7) == 0
    crossed = two_nodes.link_bytes(decode.index) - before
    assert crossed >= n * BLOCK_BYTES, f"only {crossed} bytes crossed the decode's link"

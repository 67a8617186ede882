"""Across simulated nodes (one kernel, but each node with its own /dev/shm and IPC
namespace, as pods without a shared pool directory) a pull asked to take the host
path stays on the network, and the consumer daemon's status says why; two daemons
of one simulated node (its /dev/shm shared) take the host path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.multinode.harness import TOKEN, Cluster

pytestmark = [pytest.mark.nixl, pytest.mark.multinode]

MODEL = {"name": "mnh", "num_kv_heads": 4, "num_layers": 8, "head_dim": 64}
NUM_BLOCKS = 32
HOST = ["--set", "host_pulls=true"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(2, tmp_path_factory.mktemp("mnh")) as c:
        for node in c.nodes:
            node.start_daemon(args=HOST)
        yield c


def _pull(prefill, decode, tag: str, daemon: str = "kvd") -> tuple[dict, list]:
    pe, de = f"pre{tag}", f"dec{tag}"
    prefill.call("register", daemon="kvd", engine_id=pe, model=MODEL, tp_size=1,
                 num_blocks=NUM_BLOCKS)
    decode.call("register", daemon=daemon, engine_id=de, model=MODEL, tp_size=1,
                num_blocks=NUM_BLOCKS)
    p_ids, d_ids = list(range(4, 20)), list(range(31, 15, -1))
    tokens = len(p_ids) * 16
    prefill.call("write", engine_id=pe, block_ids=p_ids, tokens=tokens, seed=3)
    prefill.call("publish", engine_id=pe, request_id=f"r{tag}", block_ids=p_ids)
    decode.call("pull", engine_id=de, request_id=f"r{tag}", remote_engine_id=pe,
                remote_address=prefill.peer_address, remote_block_ids=p_ids,
                local_block_ids=d_ids, num_tokens=tokens)
    recv = decode.call("wait", engine_id=de, request_id=f"r{tag}", kind="done_recving",
                       timeout_s=30)
    sent = prefill.call("wait", engine_id=pe, request_id=f"r{tag}", kind="done_sending",
                        timeout_s=30)
    assert recv["ok"] and sent["ok"], (recv, sent)
    assert decode.call("check", engine_id=de, block_ids=d_ids, tokens=tokens, seed=3) == 0
    st = decode.call("status", name=daemon)
    paths = [p["path"] for p in st["finished_pulls"] if p["request_id"] == f"r{tag}"]
    return st, paths


def test_a_pull_across_nodes_stays_remote_and_status_says_why(two_nodes: Cluster) -> None:
    prefill, decode = two_nodes.nodes
    st, paths = _pull(prefill, decode, "x")
    assert paths == ["remote"]
    assert st["peers"] and {p["path"] for p in st["peers"]} == {"remote"}, st["peers"]
    why = st["peers"][0]["why"]
    assert "same host, but another IPC namespace" in why, why
    assert decode.call("metric", name="kvd", metric="kvd_transfers_total", role="consumer",
                       path="host") == 0


def test_two_daemons_of_one_node_take_the_host_path(two_nodes: Cluster) -> None:
    node = two_nodes.nodes[0]
    node.call("start_daemon", name="kvd2", peer_address=node.peer_address.rsplit(":", 1)[0]
              + ":7301", token=TOKEN, engine_port=7300, metrics_port=7302, args=HOST, env=None)
    st, paths = _pull(node, node, "h", daemon="kvd2")
    assert paths == ["host"]
    assert {p["path"] for p in st["peers"]} == {"host"}, st["peers"]

"""`WarmUp` over NIXL also prepares the descriptor lists of the pair's READs
(kvd.transport.remote.prepped), so that the first pull's post only picks indices, and
reads one page from the producer (`DataPath.warm_read`), so that the first pull's READ
is not the transport's first to that peer (posted inline, like every later one).

The lists are keyed by a chunk that the posted descriptors decide (``common_chunk``):
the warm-up prepares them from a sample pull's reads, and the first real pull of
random blocks must find them (no list of its own). Real NIXL between two processes:
the producer is a ``kvd serve`` process, the consumer daemon runs in this process (on
the real clock) so that its transport's lists can be counted; pool layouts whose
descriptors differ (per layer and K/V, per block, per head range)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from support.cluster import start_daemon, stop_and_check_clean
from support.inprocess import config, sample

from kvd.client import AsyncKvdClient, KvdClient
from kvd.daemon.server import Daemon
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.transport.base import ReadPost
from kvd.wire.protocol import ModelSpec

pytestmark = pytest.mark.nixl

BLOCKS = 25  # a 800-token prompt
# the bytes of kvd bench vllm's tiny Llama (16 KiB per layer, K or V and block) in a
# 16-bit dtype (what kvd.tools.sim writes and checks), and another
TINY = ModelSpec(name="tiny", num_kv_heads=2, num_layers=4, head_dim=128, dtype="bfloat16")
BF16 = ModelSpec(name="b", num_kv_heads=8, num_layers=3, head_dim=64, dtype="bfloat16")
CASES = [(TINY, "kv_split"), (TINY, "cross_layer"), (TINY, "head_major"), (BF16, "kv_split")]


async def _until(what: str, pred, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("model", "kv_layout"), CASES,
                         ids=[f"8heads-{k}" if m is BF16 else k for m, k in CASES])
def test_the_first_pull_after_a_warm_up_uses_lists_prepared_ahead(
        tmp_path: Path, model: ModelSpec, kv_layout: str) -> None:
    shape = EngineShape(tp_size=1, block_size_tokens=32, num_blocks=64, kv_layout=kv_layout)
    layout = layout_spec(shape)
    g = global_kv(model, BLOCKS * shape.block_size_tokens)
    rng = np.random.default_rng(3)
    src = sorted(rng.choice(shape.num_blocks, BLOCKS, replace=False).tolist())
    dst = sorted(rng.choice(shape.num_blocks, BLOCKS, replace=False).tolist())
    producer_d = start_daemon(tmp_path, "wlp")
    pc = KvdClient(producer_d.engine_address, timeout_s=30, ping_interval_s=0)
    try:
        pre = pc.register("pre", model, layout)
        write_shard(pre.kv, g, model, shape, 0, 0, src)

        async def body() -> None:
            d = Daemon(config(f"kvd-wl-{uuid.uuid4().hex[:8]}", host_pulls=False,
                              handshake_timeout_s=10.0))
            await d.start()
            dc = AsyncKvdClient(d.cfg.engine_address, timeout_s=30, ping_interval_s=0)
            try:
                dec = await dc.register("dec", model, layout)
                await dc.warm_up("dec", [("pre", producer_d.peer_address)])

                async def lists() -> int:
                    return (await d.datapath.counts()).prepared_lists

                async def warmed() -> bool:  # no pull yet: a READ to the producer would
                    remote = d.peers.cached("dec", "pre", producer_d.peer_address)
                    if remote is None:  # post inline, as READs to a peer already read
                        return False
                    one = np.array([1 << 20])
                    return d.datapath.can_post_now([ReadPost(
                        peer=next(iter(remote.ranks.values())).agent, local_addrs=one,
                        remote_addrs=one, nbytes=np.array([4096]), mem_type="DRAM",
                        notif=b"")])

                await _until("the warm-up's READ", warmed)
                # a local and a remote list on each posting worker that reaches the peer
                warm_lists = await lists()
                assert warm_lists > 0
                assert sample(d, "kvd_transfers_total", role="consumer", path="remote",
                              outcome="ok") == 0

                receipt = pc.publish("pre", "r1", src)
                ev = await dc.pull_and_wait("dec", "r1", "pre", producer_d.peer_address,
                                            src, dst, publish_receipt=receipt)
                assert ev.ok, ev.error
                assert check_shard(dec.kv, g, model, shape, 0, 0, dst) == 0
                # the first pull went through the lists the warm-up made: none of its own
                assert await lists() == warm_lists
                assert sample(d, "kvd_transfers_total", role="consumer", path="remote",
                              outcome="ok") == 1
            finally:
                dc.close()
                await d.stop()
            assert d.shutdown_counts.registrations == 0  # the warm READ's page too

        asyncio.run(body())
    finally:
        pc.close()
        stop_and_check_clean(producer_d)

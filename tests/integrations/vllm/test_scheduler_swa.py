"""Sliding-window + full-attention model prefill -> decode through kvd, at scheduler level.

vLLM's hybrid allocator puts full-attention and sliding-window layers in two
KV-cache groups (as for Gemma-2/3 or Mistral with interleaved windows), and its
SlidingWindowManager puts the null block where the window has passed. The
connector publishes the sliding group without that padding, the decode side
pulls one list per group, and kvd moves only the window of the sliding group:
the full group must hold every loaded token's K/V, the sliding group the tokens
the token the decode computes first still attends to, byte for byte, and
nothing before the window's first block.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

import scheduler_support as ss  # noqa: E402
import torch  # noqa: E402
from engine_build import make_multi_group_engine  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

# tokens. The decode computes the last prompt token (149), which attends to tokens
# [127, 149]: token 127 ends a block of 32, the block a window counted from all 150
# prompt tokens (from 128) would leave out (vLLM nulls it when a load covers the
# whole prompt; the connector's prefill stops one token short instead).
WINDOW = 23
FULL_LAYERS, SLIDING_LAYERS = (0, 2), (1, 3)
NAMES = {i: f"model.layers.{i}.self_attn.attn" for i in range(4)}
PROMPT = 150  # 5 blocks of 32, the last partial
DAEMON_ARGS: list[str] = []  # the conftest's ``daemons`` with kvd's defaults


class SwaEngine(ss.SimEngine):
    """SimEngine over two groups; the fake forward writes every layer through the block
    list of its own group."""

    def group_ids(self, request_id: str) -> list[list[int]]:
        return [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(request_id)]

    def block_ids(self, request_id: str) -> list[int]:  # type: ignore[override]
        return self.group_ids(request_id)  # type: ignore[return-value]

    def kind(self, g: int) -> str:
        spec = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec
        return "sliding" if isinstance(spec, SlidingWindowSpec) else "full"

    def group_of(self, layer: int) -> int:
        return next(g for g, grp in enumerate(self.kv_cache_config.kv_cache_groups)
                    if NAMES[layer] in grp.layer_names)

    def _forward(self, request_id: str, start: int, end: int) -> None:
        self.computed.setdefault(request_id, []).append((start, end))
        groups = self.blocks_seen[request_id] = self.group_ids(request_id)  # type: ignore
        for layer in range(4):
            ids = groups[self.group_of(layer)]
            live = [t for t in range(start, end) if ids[t // self.block_size] != 0]
            if not live:
                continue
            pos, blk, off = ss._slots(ids, self.block_size, live[0], live[-1] + 1)
            for rank, cache in enumerate(self.caches):
                view = cache[NAMES[layer]].view(torch.int32)  # [block, head, token, K||V]
                view[blk, :, off, :] = ss.kv_pattern(self.tag, layer, pos, self._heads(rank),
                                                     view.shape[-1])

    def _zero(self, block_ids: list[int]) -> None:
        for cache in self.caches:
            for name in NAMES.values():
                cache[name][block_ids] = 0

    def mismatches(self, groups: list[list[int]], layer: int, start: int, end: int, tag: int,
                   caches: list[dict[str, torch.Tensor]]) -> int:
        ids = groups[self.group_of(layer)]
        pos, blk, off = ss._slots(ids, self.block_size, start, end)
        bad = 0
        for rank, cache in enumerate(caches):
            view = cache[NAMES[layer]].view(torch.int32)
            want = ss.kv_pattern(tag, layer, pos, self._heads(rank), view.shape[-1])
            bad += int((view[blk, :, off, :] != want).sum())
        return bad


def make_swa_engine(name: str, model_dir: Path, kvd_address: str, *, tp_size: int = 1,
                    num_blocks: int = 32, block_size: int = 32) -> SwaEngine:
    def specs(_: object) -> dict[str, object]:
        heads = ss.NUM_KV_HEADS // tp_size
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                 head_size=ss.HEAD_DIM, dtype=ss.DTYPE)
        swa = SlidingWindowSpec(block_size=block_size, num_kv_heads=heads,
                                head_size=ss.HEAD_DIM, dtype=ss.DTYPE, sliding_window=WINDOW)
        return {NAMES[i]: (full if i in FULL_LAYERS else swa) for i in range(4)}

    return make_multi_group_engine(SwaEngine, name, model_dir, kvd_address, specs,
                                      block_size=block_size, num_blocks=num_blocks,
                                      tp_size=tp_size)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1)])
def test_sliding_window_group_moves_only_the_window(daemons, tmp_path: Path, p_tp: int,
                                                    d_tp: int) -> None:
    pd, dd = daemons
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**ss.MODEL_CONFIG,
                                                       "num_hidden_layers": len(NAMES)}))
    p = make_swa_engine("spre", model_dir, pd.engine_address, tp_size=p_tp)
    d = make_swa_engine("sdec", model_dir, dd.engine_address, tp_size=d_tp)
    try:
        kinds = [p.kind(g) for g in range(2)]
        assert sorted(kinds) == ["full", "sliding"], kinds
        prompt = ss.prompt_tokens(31, PROMPT)
        params = ss.prefill(p, "s1", prompt)
        loaded = params["remote_num_tokens"]
        assert loaded == PROMPT - 1, params  # the prefill stopped one token short
        groups = params["remote_block_ids"]
        assert len(groups) == 2 and 0 not in groups[kinds.index("sliding")], groups
        d.add("s1", prompt, max_tokens=3, kv_transfer_params=params)
        ss.run_until([p, d], lambda: "s1" in d.received, what="decode s1 to receive")
        got = d.received["s1"]
        failed = got.failed
        assert not failed, "the decode's pull failed"
        # the decode recomputes the last prompt token; the first token it attends to:
        first = (PROMPT - 1) - WINDOW + 1
        ids = got.block_ids
        # (plain ints in the asserts: the caches live in pools freed once the engines close)
        bad = {layer: d.mismatches(ids, layer, 0 if layer in FULL_LAYERS else first, loaded,
                                   p.tag, got.caches) for layer in range(4)}
        assert not any(bad.values()), f"mismatching elements per layer {bad}, blocks {ids}"
        sliding_ids = got.block_ids[kinds.index("sliding")]
        # tokens before the window's block were not moved: their slots (if any) are empty
        before = [b for b in sliding_ids[:first // d.block_size] if b != 0]
        moved_early = sum(int(c[NAMES[layer]][b].abs().sum() > 0) for c in got.caches
                          for layer in SLIDING_LAYERS for b in before)
        assert moved_early == 0, f"sliding blocks before the window were written: {before}"
        ss.run_until([p, d], lambda: d.finished("s1"), what="decode s1 to finish")
        assert d.computed["s1"][0][0] == PROMPT - 1
        ss.drain([p, d])
    finally:
        for e in (p, d):
            e.close()
        for e, daemon in ((p, pd), (d, dd)):
            with daemon.client(ping_interval_s=0) as c:
                deadline = time.monotonic() + 10
                while [x for x in c.status().engines if x.engine_id == e.engine_id]:
                    assert time.monotonic() < deadline, f"{e.engine_id} not freed"
                    time.sleep(0.05)

"""The shape matrix of pulls between two engines of one attention model: the model and
engine shapes, and the cases every byte-exact pull test runs (through NIXL between
daemons: tests/daemon/pull/test_matrix.py; inside one daemon: test_local_pull.py,
test_cuda_local_pull.py; same host: test_host_pull.py; a CUDA pool: tests/pool/)."""

from __future__ import annotations

from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec


def model(k: int = 8, layers: int = 4, head_dim: int = 64, mla: bool = False) -> ModelSpec:
    return ModelSpec(name="itest-model", num_kv_heads=k, num_layers=layers, head_dim=head_dim,
                     dtype="bfloat16", mla=mla)


def shape(tp: int, pp: int = 1, bs: int = 16, blocks: int = 40, kv_layout: str = "kv_split",
          head_layout: str = "HND") -> EngineShape:
    return EngineShape(tp_size=tp, pp_size=pp, block_size_tokens=bs, num_blocks=blocks,
                       kv_layout=kv_layout, head_layout=head_layout)


# id: (model, prefill shape, decode shape, tokens, skip_tokens)
CASES = {
    "homogeneous-tp2-tp2": (model(), shape(2), shape(2), 256, 0),
    "decode-tp-larger-1-2": (model(), shape(1), shape(2), 256, 0),
    "decode-tp-larger-2-4": (model(), shape(2), shape(4), 256, 0),
    "prefill-tp-larger-4-2": (model(), shape(4), shape(2), 256, 0),
    "gqa-k2-1-4": (model(k=2), shape(1), shape(4), 256, 0),
    "gqa-k2-4-1": (model(k=2), shape(4), shape(1), 256, 0),
    "gqa-k2-4-8": (model(k=2), shape(4), shape(8), 256, 0),
    "mla-2-3": (model(k=1, head_dim=96, mla=True), shape(2), shape(3), 256, 0),
    "mla-4-1": (model(k=1, head_dim=96, mla=True), shape(4), shape(1), 256, 0),
    "non-multiple-k24-6-4": (model(k=24, head_dim=32), shape(6), shape(4), 128, 0),
    "non-multiple-k12-4-6": (model(k=12, head_dim=32), shape(4), shape(6), 128, 0),
    "pp2-pp1": (model(), shape(1, pp=2), shape(1), 256, 0),
    "tp2pp1-tp1pp3-10-layers": (model(layers=10), shape(2), shape(1, pp=3), 128, 0),
    "prefix-hit-tail-only": (model(), shape(2), shape(2), 256, 160),
    "block-ratio-16-32": (model(), shape(2, bs=16), shape(2, bs=32), 256, 0),
    "block-ratio-32-16": (model(), shape(2, bs=32), shape(2, bs=16), 256, 0),
    "block-ratio-16-32-partial-last": (model(), shape(1, bs=16), shape(2, bs=32), 200, 0),
    "block-ratio-16-32-prefix-hit": (model(), shape(2, bs=16), shape(1, bs=32), 256, 128),
    "block-ratio-32-16-prefix-hit": (model(), shape(1, bs=32), shape(2, bs=16), 256, 64),
    "blocks-first-2-1": (model(), shape(2, kv_layout="blocks_first"),
                         shape(1, kv_layout="blocks_first"), 256, 0),
    "blocks-first-1-2": (model(), shape(1, kv_layout="blocks_first"),
                         shape(2, kv_layout="blocks_first"), 256, 0),
    "cross-layer-2-2": (model(), shape(2, kv_layout="cross_layer"),
                        shape(2, kv_layout="cross_layer"), 256, 0),
    "cross-layer-2-1": (model(), shape(2, kv_layout="cross_layer"),
                        shape(1, kv_layout="cross_layer"), 256, 0),
    "head-major-1-2": (model(), shape(1, kv_layout="head_major"),
                       shape(2, kv_layout="head_major"), 256, 0),
    "head-major-2-2": (model(), shape(2, kv_layout="head_major"),
                       shape(2, kv_layout="head_major"), 256, 0),
    "head-major-4-2-pp2": (model(), shape(4, pp=2, kv_layout="head_major"),
                           shape(2, kv_layout="head_major"), 256, 0),
    "nhd-homogeneous-2-2": (model(), shape(2, head_layout="NHD"), shape(2, head_layout="NHD"),
                            256, 0),
}

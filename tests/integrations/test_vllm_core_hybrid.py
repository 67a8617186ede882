"""vLLM's KV-cache groups to kvd's hybrid description: plain values, no vLLM needed."""

from __future__ import annotations

import pytest

from kvd.daemon.hybrid import hybrid_model
from kvd.errors import LayoutError
from kvd.integrations.vllm_core.hybrid import (
    VllmCacheGroup,
    VllmMambaConfig,
    hybrid_spec,
    layer_index,
)
from kvd.planner.hybrid import vllm_groups
from kvd.protocol import LayerSpec, ModelSpec

PATTERN = "M*S-M*MS"  # Mamba 0 4 6, attention 1 5, sliding 2 7, MLP 3
MAMBA = VllmMambaConfig(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=4)


def names(*ids: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.mixer" for i in ids)


def mamba_group(ids: tuple[int, ...], tp: int, sd: bool = False) -> VllmCacheGroup:
    channels = 24 // tp * 2 + 2 * (2 // tp if tp <= 2 else 1) * 4
    conv = (3, channels) if sd else (channels, 3)
    return VllmCacheGroup("MambaSpec", names(*ids), mamba_shapes=(conv, (24 // tp, 2, 4)),
                          mamba_dtypes=("torch.bfloat16", "torch.float32"))


def vllm_like(tp: int, sd: bool = False) -> list[VllmCacheGroup]:
    """What vLLM's allocator groups for PATTERN (2 layers a group, specs by first use)."""
    return [mamba_group((0, 4), tp, sd), mamba_group((6,), tp, sd),
            VllmCacheGroup("FullAttentionSpec", names(1, 5)),
            VllmCacheGroup("SlidingWindowSpec", names(2, 7), sliding_window=7)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_groups_map_to_the_hybrid_description(tp: int) -> None:
    spec = hybrid_spec(vllm_like(tp), num_layers=8, tp_size=tp, mamba=MAMBA)
    assert [x.kind[0] for x in spec.layers] == ["m", "a", "s", "n", "m", "a", "m", "s"]
    assert spec.layers[2] == LayerSpec("sliding", 7) and spec.layers[3] == LayerSpec("none")
    assert spec.groups == [[0, 4], [6], [1, 5], [2, 7]]  # vLLM's order: block_ids pair by it
    assert spec.mamba is not None and spec.conv_layout == "DS"
    assert (spec.mamba.conv_dtype, spec.mamba.ssm_dtype) == ("bfloat16", "float32")
    model = hybrid_model(ModelSpec(name="m", num_kv_heads=2, num_layers=8, head_dim=4,
                                   hybrid=spec))
    # the planner's restatement of vLLM's grouping agrees with the groups given
    assert [list(g.layers) for g in vllm_groups(model.layers)] == spec.groups
    assert [list(g.layers) for g in model.groups] == spec.groups


def test_state_first_conv_is_detected() -> None:
    assert hybrid_spec(vllm_like(2, sd=True), 8, 2, MAMBA).conv_layout == "SD"


def test_rank_shapes_must_match_the_config() -> None:
    with pytest.raises(LayoutError, match="SSM state shape"):
        hybrid_spec(vllm_like(2), 8, 4, MAMBA)  # shapes of TP 2 told as TP 4
    wrong = VllmMambaConfig(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=5)
    with pytest.raises(LayoutError, match="conv state shape"):
        hybrid_spec(vllm_like(2), 8, 2, wrong)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(LayoutError, match="ChunkedLocalAttentionSpec is not supported"):
        hybrid_spec([VllmCacheGroup("ChunkedLocalAttentionSpec", names(1))], 8, 1)
    with pytest.raises(LayoutError, match="no Mamba config"):
        hybrid_spec(vllm_like(1), 8, 1)
    with pytest.raises(LayoutError, match="in two KV-cache groups"):
        hybrid_spec([VllmCacheGroup("FullAttentionSpec", names(1)),
                     VllmCacheGroup("FullAttentionSpec", names(1))], 8, 1)
    with pytest.raises(LayoutError, match="layer index"):
        layer_index("decoder.block3.attn")
    assert layer_index("model.layers.17.self_attn.attn") == 17

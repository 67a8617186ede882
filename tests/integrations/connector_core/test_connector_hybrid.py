"""vLLM's KV-cache groups to kvd's hybrid description: plain values, no vLLM needed."""

from __future__ import annotations

import pytest

from kvd.errors import LayoutError
from kvd.integrations.connector_core.hybrid import (
    VllmCacheGroup,
    VllmHybridGeometry,
    VllmMambaConfig,
    hybrid_spec,
    layer_numbering,
)
from kvd.planner.hybrid.plan import vllm_groups
from kvd.pool.geometry import hybrid_model
from kvd.wire.protocol import LayerSpec, ModelSpec

PATTERN = "M*S-M*MS"  # Mamba 0 4 6, attention 1 5, sliding 2 7, MLP 3
MAMBA = VllmMambaConfig(num_heads=24, head_dim=2, n_groups=2, d_state=4, conv_kernel=4)


def names(*ids: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.mixer" for i in ids)


def mamba_group(ids: tuple[int, ...], tp: int, sd: bool = False) -> VllmCacheGroup:
    channels = 24 // tp * 2 + 2 * (2 // tp if tp <= 2 else 1) * 4
    conv = (3, channels) if sd else (channels, 3)
    return VllmCacheGroup("MambaSpec", names(*ids), mamba_shapes=(conv, (24 // tp, 2, 4)),
                          mamba_dtypes=("torch.bfloat16", "torch.float32"), layer_ids=ids)


def vllm_like(tp: int, sd: bool = False) -> list[VllmCacheGroup]:
    """What vLLM's allocator groups for PATTERN (2 layers a group, specs by first use)."""
    return [mamba_group((0, 4), tp, sd), mamba_group((6,), tp, sd),
            VllmCacheGroup("FullAttentionSpec", names(1, 5), layer_ids=(1, 5)),
            VllmCacheGroup("SlidingWindowSpec", names(2, 7), sliding_window=7,
                           layer_ids=(2, 7))]


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


# ------------------------------------------- layer numbers from vLLM's allocation

def test_model_layer_indices_are_kept_where_vllm_gives_them() -> None:
    numbers, total, by_model = layer_numbering(vllm_like(1), 8)
    assert by_model and total == 8 and numbers["model.layers.6.mixer"] == 6


def falcon_h1_like(tp: int) -> list[VllmCacheGroup]:
    """Falcon-H1 in vLLM 0.32: attention and Mamba in each of 3 layers, the Mamba named
    past the model's layers ("model.3.mixer" is layer 0's)."""
    att = VllmCacheGroup("FullAttentionSpec", tuple(f"model.layers.{i}.attn" for i in range(3)),
                         layer_ids=(0, 1, 2))
    m = mamba_group((3, 4, 5), tp)
    m = VllmCacheGroup(m.spec_type, ("model.3.mixer", "model.4.mixer", "model.5.mixer"),
                       mamba_shapes=m.mamba_shapes, mamba_dtypes=m.mamba_dtypes,
                       layer_ids=(3, 4, 5))
    return [att, m]


@pytest.mark.parametrize("tp", [1, 2])
def test_parallel_attention_and_mamba_number_cache_layers_in_allocation_order(tp: int) -> None:
    """Falcon-H1: vLLM's indices run past the model's 3 layers, so kvd numbers the 6 cache
    layers position-major: tensor position l holds attention 2l and Mamba 2l + 1."""
    groups = falcon_h1_like(tp)
    numbers, total, by_model = layer_numbering(groups, 3)
    assert not by_model and total == 6
    assert numbers == {"model.layers.0.attn": 0, "model.3.mixer": 1, "model.layers.1.attn": 2,
                       "model.4.mixer": 3, "model.layers.2.attn": 4, "model.5.mixer": 5}
    spec = hybrid_spec(groups, 3, tp, MAMBA)
    assert [x.kind[0] for x in spec.layers] == ["a", "m"] * 3
    assert spec.groups == [[0, 2, 4], [1, 3, 5]]
    model = hybrid_model(ModelSpec(name="f", num_kv_heads=2, num_layers=6, head_dim=4,
                                   hybrid=spec))
    assert [list(g.layers) for g in model.groups] == spec.groups


def test_shared_attention_names_without_a_model_layer_number_by_position() -> None:
    """Zamba2: shared attention "model.attn.j" and Mamba "N.mixer" in three groups."""
    att = VllmCacheGroup("FullAttentionSpec", ("model.attn.0", "model.attn.1"),
                         layer_ids=(0, 1))
    m1, m2 = mamba_group((2, 4), 1), mamba_group((3, 5), 1)
    groups = [att, VllmCacheGroup("MambaSpec", ("2.mixer", "4.mixer"),
                                  mamba_shapes=m1.mamba_shapes, mamba_dtypes=m1.mamba_dtypes,
                                  layer_ids=(2, 4)),
              VllmCacheGroup("MambaSpec", ("3.mixer", "5.mixer"),
                             mamba_shapes=m2.mamba_shapes, mamba_dtypes=m2.mamba_dtypes,
                             layer_ids=(3, 5))]
    spec = hybrid_spec(groups, 4, 1, MAMBA)
    assert spec.groups == [[0, 3], [1, 4], [2, 5]]
    assert [x.kind[0] for x in spec.layers] == ["a", "m", "m"] * 2


def test_names_vllm_cannot_index_number_by_position() -> None:
    groups = [VllmCacheGroup("FullAttentionSpec", ("decoder.block.attn", "decoder.x.attn"),
                             layer_ids=(None, None))]
    numbers, total, by_model = layer_numbering(groups, 2)
    assert (numbers, total, by_model) == ({"decoder.block.attn": 0, "decoder.x.attn": 1}, 2,
                                          False)


def test_pipeline_parallel_is_refused_without_model_layer_numbers() -> None:
    geom = VllmHybridGeometry(
        model_name="tiny", groups=tuple(falcon_h1_like(1)), num_layers=3, total_kv_heads=2,
        head_size=4, dtype="float32", mla=False, kernel_block_tokens=32, num_blocks=8,
        buf_nbytes=1, mamba=MAMBA, pp_size=2, layer_partition=(2, 1),
        model_class="FalconH1ForCausalLM")
    with pytest.raises(LayoutError, match=r"^FalconH1ForCausalLM: vLLM's cache layer names "
                                          r"\(e.g. 'model.layers.0.attn'\) give no model layer"):
        geom.check_allocation()


# ---------------------------------------------------------------- block lists

from kvd.integrations.connector_core.hybrid import publish_groups, pull_groups  # noqa: E402
from kvd.integrations.connector_core.params import RemotePrefill, parse_remote_prefill  # noqa: E402


def test_publish_groups_clips_like_nixl() -> None:
    kinds = ("mamba", "attention", "sliding")
    ids = ([0, 0, 7], [3, 4, 5, 6], [0, 0, 9, 10])
    # 70 tokens at 32 a block: 3 blocks; sliding padding and Mamba padding dropped
    assert publish_groups(kinds, ids, 70, (2048, 32, 32)) == [[7], [3, 4, 5], [9]]
    assert publish_groups(kinds, ids, 128, (2048, 32, 32)) == [[7], [3, 4, 5, 6], [9, 10]]
    with pytest.raises(LayoutError):
        publish_groups(kinds, ids[:2], 70, (2048, 32, 32))


def test_pull_groups() -> None:
    kinds = ("mamba", "attention", "sliding")
    new = ([8], [1, 2, 3, 4], [5, 6, 7, 11])
    assert pull_groups(kinds, new, 99, 0, (2048, 32, 32)) == [[8], [1, 2, 3, 4], [5, 6, 7, 11]]
    assert pull_groups(kinds, new, 90, 0, (2048, 32, 32)) == [[8], [1, 2, 3], [5, 6, 7]]
    # a sliding group whose leading blocks were padding keeps its tail
    assert pull_groups(kinds, ([8], [1, 2, 3], [6, 7]), 90, 0, (2048, 32, 32))[2] == [6, 7]
    with pytest.raises(LayoutError, match="cannot hold"):
        pull_groups(kinds, ([8], [1], [2]), 90, 0, (2048, 32, 32))
    with pytest.raises(LayoutError, match="multiple"):
        pull_groups(kinds, new, 90, 5, (2048, 32, 32))


def test_params_carry_one_list_per_group() -> None:
    remote = RemotePrefill("e", "r", "tcp://x:1", (7, 3, 4), 70, 32, ((7,), (3, 4)))
    params = remote.to_params()
    assert params["remote_block_ids"] == [[7], [3, 4]]
    back = parse_remote_prefill(params)
    assert back.group_block_ids == ((7,), (3, 4)) and back.block_ids == (7, 3, 4)
    # one group in per-group form stays flat
    one = parse_remote_prefill({**params, "remote_block_ids": [[3, 4]]})
    assert one.group_block_ids is None and one.block_ids == (3, 4)

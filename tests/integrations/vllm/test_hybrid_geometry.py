"""The global Mamba2 geometry kvd plans with comes from vLLM's objects, for every family.

vLLM's per-rank MambaSpec does not say how the conv channels split into x, B and C;
kvd asks vLLM's shape calculator of the model class at TP 1 instead of reading each
family's config names (Granite and Falcon-H1 call them ``mamba_n_heads`` and
``mamba_d_head``, Zamba2 ``n_mamba_heads``, Mamba2 ``num_heads``). Config-only model
directories from transformers' own config classes; no engine starts.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from engine_build import engine_config  # noqa: E402
from tiny_hybrid_models import make_config  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402

import kvd.integrations.vllm.vllm_geometry as vg  # noqa: E402
from kvd.errors import LayoutError  # noqa: E402
from kvd.integrations.connector_core.hybrid import VllmMambaConfig  # noqa: E402

pytestmark = [pytest.mark.vllm]

ARCH = {"granitemoehybrid": "GraniteMoeHybridForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
        "mamba2": "Mamba2ForCausalLM", "zamba2": "Zamba2ForCausalLM"}
WANT = VllmMambaConfig(num_heads=16, head_dim=32, n_groups=2, d_state=16, conv_kernel=4)


def _config(tmp_path: Path, family: str, tp: int = 1):
    import json

    cfg = make_config(family).to_dict()
    cfg["architectures"] = [ARCH[family]]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return engine_config(f"geo-{family}", tmp_path, "tcp://127.0.0.1:1", block_size=64,
                         tp_size=tp, prefix_caching=False)


def _mamba2_spec() -> SimpleNamespace:
    return SimpleNamespace(mamba_type=MambaAttentionBackendEnum.MAMBA2,
                           shapes=((3, 576), (16, 32, 16)))


@pytest.mark.parametrize("family", list(ARCH))
@pytest.mark.parametrize("tp", [1, 2])
def test_global_mamba_geometry_from_vllms_shape_calculator(tmp_path: Path, family: str,
                                                           tp: int) -> None:
    """The same global geometry at any TP (the calculator runs at TP 1)."""
    assert vg.mamba_config(_config(tmp_path, family, tp), [_mamba2_spec()]) == WANT


def test_other_mamba_kinds_are_refused_naming_the_class(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "granitemoehybrid")
    spec = SimpleNamespace(mamba_type=MambaAttentionBackendEnum.MAMBA1,
                           shapes=((3, 576), (512, 16)))
    with pytest.raises(LayoutError, match=r"^GraniteMoeHybridForCausalLM: vLLM's Mamba state "
                                          r"is MAMBA1; kvd moves Mamba2 \(MambaMixer2\) "
                                          r"states only$"):
        vg.mamba_config(cfg, [spec])


def test_a_class_without_a_shape_calculator_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path, "mamba2")

    class NoCalculator:
        pass

    monkeypatch.setattr(vg, "model_class", lambda _: NoCalculator)
    with pytest.raises(LayoutError, match="^NoCalculator has no "
                                          "get_mamba_state_shape_from_config"):
        vg.mamba_config(cfg, [_mamba2_spec()])


def test_conv_channels_that_do_not_split_into_x_b_c_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path, "mamba2")

    class OddConv:
        @staticmethod
        def get_mamba_state_shape_from_config(_: object) -> tuple:
            return (3, 530), (16, 32, 16)  # 18 channels beyond x: not 2 x n_groups x 16

    monkeypatch.setattr(vg, "model_class", lambda _: OddConv)
    with pytest.raises(LayoutError, match="^OddConv: cannot split vLLM's conv state of 530 "
                                          "channels into x"):
        vg.mamba_config(cfg, [_mamba2_spec()])

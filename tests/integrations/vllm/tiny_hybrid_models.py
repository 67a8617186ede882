"""Tiny, deterministic hybrid models of each family vLLM's CPU build runs, built with
transformers' own classes.

Why transformers' classes (not hand-written tensors): the checkpoint then has exactly
the names, shapes and config fields the family ships with, so the connector meets
what a user's engine meets (Granite and Falcon-H1 name their Mamba fields
``mamba_n_heads``/``mamba_d_head``; Falcon-H1 puts attention and Mamba in every
layer; Zamba2 shares attention blocks). The weights are re-drawn from one torch seed
with large output projections and a slow Mamba step (dt ~ 0.01, about a hundred
tokens of memory), so the output depends on the whole prompt through the Mamba
state as well as through attention: ``mamba_matters`` checks that with every
attention output zeroed (``test_engine_hybrid_families.py`` runs it before trusting
an equality of tokens).

Each model: float32, hidden 256, attention 4 query / 2 KV heads of 64 (CPU
attention refuses smaller heads), Mamba2 16 heads of 32 with 2 groups, d_state
16, conv kernel 4, vocab 512, 4 layers; a few MB. Same tokenizer as the tiny Llama.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from kvd.tools.tiny_model.llama import VOCAB_SIZE, build_model_dir, write_tokenizer

BUILDER_VERSION = 1
SEED = 20261126
DT = 0.01
HIDDEN = 256
COMMON: dict[str, Any] = {"vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN,
                          "max_position_embeddings": 4096, "tie_word_embeddings": False,
                          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                          "torch_dtype": "float32"}

# family -> (transformers config class, its fields)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        "layer_types": ["mamba", "attention", "mamba", "attention"], "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
        "shared_intermediate_size": 256, "num_local_experts": 0, "num_experts_per_tok": 0,
        "position_embedding_type": "nope", "mamba_n_heads": 16, "mamba_d_head": 32,
        "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": 128, "embedding_multiplier": 1.0, "logits_scaling": 1.0,
        "residual_multiplier": 1.0, "attention_multiplier": 1.0 / 8}),
    "falcon_h1": ("FalconH1Config", {
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "intermediate_size": 256, "mamba_n_heads": 16, "mamba_d_head": 32,
        "mamba_d_ssm": 512, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 128, "mamba_rms_norm": False}),
    "mamba2": ("Mamba2Config", {
        "num_hidden_layers": 3, "num_heads": 16, "head_dim": 32, "expand": 2, "n_groups": 2,
        "state_size": 16, "conv_kernel": 4, "chunk_size": 128, "residual_in_fp32": False}),
    "zamba2": ("Zamba2Config", {
        "num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "num_mem_blocks": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "attention_head_dim": 128, "intermediate_size": 256, "mamba_headdim": 32,
        "n_mamba_heads": 16, "mamba_ngroups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "chunk_size": 128, "use_shared_attention_adapter": False,
        "use_mem_rope": False}),
}

# std in units of 1/sqrt(fan_in) by the parameter's last name part; others 1.0
SCALES = {"out_proj": 4.0, "o_proj": 4.0, "lm_head": 4.0, "v_proj": 4.0, "embed": 0.3}


def spec_hash(family: str) -> str:
    blob = json.dumps({"builder_version": BUILDER_VERSION, "family": FAMILIES[family],
                       "common": COMMON, "scales": SCALES, "seed": SEED, "dt": DT},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def make_config(family: str) -> Any:
    import transformers

    cls_name, fields = FAMILIES[family]
    return getattr(transformers, cls_name)(**COMMON, **fields)


def _reinit(model: Any) -> None:
    """Re-draw every weight from SEED so that both mixers carry the prompt."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
            if leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 0.75 + 0.25))
            elif leaf == "dt_bias":
                p.fill_(math.log(math.expm1(DT)))
            elif leaf == "D" or "norm" in name:  # norm weights 1, norm biases 0
                if leaf == "bias":
                    p.zero_()
                else:
                    p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * SCALES["embed"])
            elif p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                scale = SCALES.get(owner, SCALES["lm_head"] if "lm_head" in name else 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(fan_in))
            else:
                p.fill_(1.0)


def _write_all(family: str, out: Path) -> None:
    import torch
    import transformers

    config = make_config(family)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n")
    write_tokenizer(out, COMMON["max_position_embeddings"])


def build_tiny_family(family: str, directory: str | os.PathLike[str]) -> Path:
    """The tiny model of ``family`` in ``directory`` (reused when its stamp matches)."""
    return build_model_dir(directory, spec_hash(family), lambda out: _write_all(family, out))


def _is_attention_out(name: str) -> bool:
    return name.endswith(("o_proj.weight", "self_attn.out_proj.weight"))


def _is_mamba_out(name: str) -> bool:
    return name.endswith("out_proj.weight") and not _is_attention_out(name)


def mamba_matters(model_dir: Path, prompt_len: int = 150, differ: int = 16,
                  zero_mamba: bool = False) -> float:
    """Largest |logit difference| at the last position between two prompts that differ in
    their first ``differ`` tokens, with every attention output zeroed: > 0 only if the
    prefix reaches the output through the Mamba state (transformers' reference forward).
    ``zero_mamba`` zeroes the Mamba outputs too: the control, where it must be 0."""
    import random

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                              dtype=torch.float32)
    zeroed = {"attention": 0, "mamba": 0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_attention_out(name):
                p.zero_()
                zeroed["attention"] += 1
            elif zero_mamba and _is_mamba_out(name):
                p.zero_()
                zeroed["mamba"] += 1
    rng = random.Random(7)
    base = [rng.randrange(3, 500) for _ in range(prompt_len)]
    other = [rng.randrange(3, 500) for _ in range(differ)] + base[differ:]
    with torch.no_grad():
        a, b = (model(torch.tensor([p])).logits[0, -1] for p in (base, other))
    if model.config.model_type != "mamba2" and not zeroed["attention"]:
        raise AssertionError(f"found no attention output projection in {model_dir}")
    if zero_mamba and not zeroed["mamba"]:
        raise AssertionError(f"found no Mamba output projection in {model_dir}")
    return float((a - b).abs().max())


if __name__ == "__main__":
    import sys

    print(build_tiny_family(sys.argv[1], sys.argv[2]))

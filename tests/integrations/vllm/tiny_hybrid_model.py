"""A tiny, deterministic Nemotron-H (Mamba2 + attention) that vLLM's CPU build runs.

Why: the whole-engine hybrid test must show that a decode engine which loads
both the attention KV and the Mamba state from kvd computes what a plain engine
computes. ``load_format="dummy"`` cannot show that (its weights make outputs
ignore the prompt), so this writes a real checkpoint under Nemotron-H's
Hugging Face names from one numpy seed, scaled so that both mixers matter: the
Mamba layers keep a slowly decaying state (dt ~ 0.01, |A| <= 1, about a hundred
tokens of memory) and feed it back with a large output projection, and the
attention layers attend over the whole prefix (Nemotron-H's attention has no
positional encoding). ``test_engine_hybrid.py`` checks the prompt-sensitivity
on a plain engine before it trusts an equality.

Shape: "M*M*" (Mamba 0 2, attention 1 3), hidden 128, 8 SSM heads of 16, 2
groups, d_state 16, conv kernel 4, 4 query heads, 2 KV heads of 64, vocab 512,
float32; under 2 MB. Same tokenizer as the tiny Llama.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvd.tools.tiny_model.llama import VOCAB_SIZE, build_model_dir, write_tokenizer

BUILDER_VERSION = 1
SEED = 20261124
PATTERN = "M*M*"

CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": len(PATTERN),
    "hybrid_override_pattern": PATTERN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "expand": 1,
    "chunk_size": 128,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "layer_norm_epsilon": 1e-5,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "residual_in_fp32": False,
    "rescale_prenorm_residual": True,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Standard deviations in units of 1/sqrt(fan_in), the embedding absolute.
SCALES: dict[str, float] = {"embed": 0.3, "in_proj": 1.0, "conv": 1.0, "out_proj": 4.0,
                            "q": 3.0, "k": 3.0, "v": 4.0, "o": 4.0, "lm_head": 4.0}
DT = 0.01  # softplus(dt_bias): the Mamba step; decay exp(A * dt) per token


def spec_hash() -> str:
    blob = json.dumps({"builder_version": BUILDER_VERSION, "config": CONFIG, "scales": SCALES,
                       "seed": SEED, "dt": DT}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(SEED))
    c = CONFIG
    hidden, heads, head_dim = c["hidden_size"], c["mamba_num_heads"], c["mamba_head_dim"]
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * c["n_groups"] * c["ssm_state_size"]
    n_q = c["num_attention_heads"] * c["head_dim"]
    n_kv = c["num_key_value_heads"] * c["head_dim"]

    def mat(out_dim: int, in_dim: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) * scale / np.sqrt(in_dim)).astype(
            np.float32)

    t: dict[str, np.ndarray] = {"backbone.embeddings.weight": (
        rng.standard_normal((VOCAB_SIZE, hidden)) * SCALES["embed"]).astype(np.float32)}
    for i, kind in enumerate(PATTERN):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = np.ones(hidden, np.float32)
        if kind == "M":
            t[p + "mixer.in_proj.weight"] = mat(d_inner + conv_dim + heads, hidden,
                                                SCALES["in_proj"])
            t[p + "mixer.conv1d.weight"] = (rng.standard_normal((conv_dim, 1, c["conv_kernel"]))
                                            * SCALES["conv"] / np.sqrt(c["conv_kernel"])
                                            ).astype(np.float32)
            t[p + "mixer.conv1d.bias"] = np.zeros(conv_dim, np.float32)
            # A = -exp(A_log) in [-1, -0.25]; dt_bias = softplus^-1(DT)
            t[p + "mixer.A_log"] = np.log(rng.uniform(0.25, 1.0, heads)).astype(np.float32)
            t[p + "mixer.D"] = np.ones(heads, np.float32)
            t[p + "mixer.dt_bias"] = np.full(heads, np.log(np.expm1(DT)), np.float32)
            t[p + "mixer.norm.weight"] = np.ones(d_inner, np.float32)
            t[p + "mixer.out_proj.weight"] = mat(hidden, d_inner, SCALES["out_proj"])
        else:
            t[p + "mixer.q_proj.weight"] = mat(n_q, hidden, SCALES["q"])
            t[p + "mixer.k_proj.weight"] = mat(n_kv, hidden, SCALES["k"])
            t[p + "mixer.v_proj.weight"] = mat(n_kv, hidden, SCALES["v"])
            t[p + "mixer.o_proj.weight"] = mat(hidden, n_q, SCALES["o"])
    t["backbone.norm_f.weight"] = np.ones(hidden, np.float32)
    t["lm_head.weight"] = mat(VOCAB_SIZE, hidden, SCALES["lm_head"])
    return t


def _write_all(out: Path) -> None:
    from safetensors.numpy import save_file

    (out / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n")
    save_file(_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, CONFIG["max_position_embeddings"])


def build_tiny_nemotron_h(directory: str | os.PathLike[str]) -> Path:
    """The tiny Nemotron-H in ``directory`` (reused when its stamp matches)."""
    return build_model_dir(directory, spec_hash(), _write_all)


if __name__ == "__main__":
    import sys

    print(build_tiny_nemotron_h(sys.argv[1] if len(sys.argv) > 1 else "tiny-nemotron-h"))

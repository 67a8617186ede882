"""A tiny, deterministic, context-sensitive Llama that vLLM loads from disk
(``kvd tiny-model DIR``: offline, seconds; the vLLM quickstart and tests/integrations/vllm use it).

Why not a hub model or ``load_format="dummy"``: the machines have no model hub,
and dummy weights give outputs that ignore the prompt, so "decode after a KV
transfer matches a plain engine" would prove nothing. This model is built from
a fixed numpy seed, with value/output projections that are large relative to
the embeddings, so the residual stream is dominated by attention over the whole
prefix: prompts that differ only in their first tokens give different greedy
continuations (``test_tiny_model.py`` guards that property).

Shape: 4 layers, hidden 256, 4 query heads, 2 KV heads, head_dim 64 (CPU
attention refuses head_dim 16), vocab 512, float32 (the CPU build here has no
AVX-512, so float32 is the safe dtype). Weights are about 10 MB; its KV is 4 KiB a token.

Other shapes (``SHAPES``, ``build_tiny_llama(shape=...)``) are for benchmarks:
``kv-heavy`` keeps the small hidden size but has 8 layers of 16 KV heads (multi-head
attention), 64 KiB of KV a token: on a CPU the transfer of a long prompt's KV is then
a larger part of its time to first token (attention alone costs at least as many FLOPs
per KV byte as the prompt has tokens over four, whatever the shape, so no shape makes it
large on a CPU; this one makes it 16 times the default's per token for 8 times the
attention work).

Only ``numpy``, ``safetensors`` and ``tokenizers`` are needed (vLLM brings both;
``kvd[tiny-model]`` otherwise).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Bump when the builder's output changes for the same spec.
BUILDER_VERSION = 2  # 2: a chat template (OpenAI chat completions)

STAMP_FILE = "kvd_tiny_model.json"

VOCAB_SIZE = 512
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# First id that is an ordinary word; prompts should use ids in [FIRST_WORD_ID, VOCAB_SIZE).
FIRST_WORD_ID = 3

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": UNK_ID,
}

# Standard deviations of the weight matrices, in units of 1/sqrt(fan_in) except
# the embedding (absolute). Large v/o against a small embedding: attention over
# the prefix dominates each position's residual stream. q/k at 3 make attention
# peaked enough that greedy output is not one token repeated (at 1, every
# prompt gave a single repeated token); measured with transformers on prompts of
# 100 and 400 tokens: 15-16 distinct tokens of 16, 15-16 of 16 differ when only
# the first 16 prompt tokens change, top-1/top-2 logprob margin >= 0.016.
SCALES: dict[str, float] = {
    "embed": 0.3,
    "q": 3.0,
    "k": 3.0,
    "v": 4.0,
    "o": 4.0,
    "mlp": 1.0,
    "lm_head": 4.0,
}

SEED = 20261123

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


MAX_POSITIONS = CONFIG["max_position_embeddings"]

# Benchmark shapes: what they change in CONFIG ("tiny" is CONFIG itself).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "kv-heavy": {"num_hidden_layers": 8, "num_attention_heads": 16,
                 "num_key_value_heads": 16},
}


def _config(max_positions: int, shape: str = "tiny") -> dict[str, Any]:
    if shape not in SHAPES:
        raise ValueError(f"unknown tiny-model shape {shape!r}: one of {sorted(SHAPES)}")
    return {**CONFIG, **SHAPES[shape], "max_position_embeddings": max_positions}


def kv_bytes_per_token(shape: str = "tiny") -> int:
    """K and V of every layer, float32."""
    c = _config(MAX_POSITIONS, shape)
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4


def _spec(max_positions: int = MAX_POSITIONS, shape: str = "tiny") -> dict[str, Any]:
    """Everything that determines the files; its hash names the content (the default
    shape's is what it was before shapes existed)."""
    return {
        "builder_version": BUILDER_VERSION,
        "config": _config(max_positions, shape),
        "scales": SCALES,
        "seed": SEED,
    }


def spec_hash(max_positions: int = MAX_POSITIONS, shape: str = "tiny") -> str:
    """Content hash of the model this module builds (stable across runs and machines)."""
    blob = json.dumps(_spec(max_positions, shape), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def _weights(c: dict[str, Any] = CONFIG) -> dict[str, np.ndarray]:
    """Llama weights under vLLM/HF names, float32, from one numpy RNG in a fixed order."""
    rng = np.random.Generator(np.random.PCG64(SEED))
    hidden = c["hidden_size"]
    inter = c["intermediate_size"]
    n_q = c["num_attention_heads"] * c["head_dim"]
    n_kv = c["num_key_value_heads"] * c["head_dim"]

    def mat(out_dim: int, in_dim: int, scale: float) -> np.ndarray:
        std = scale / np.sqrt(in_dim)
        return (rng.standard_normal((out_dim, in_dim)) * std).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": (
            rng.standard_normal((VOCAB_SIZE, hidden)) * SCALES["embed"]
        ).astype(np.float32)
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = mat(n_q, hidden, SCALES["q"])
        tensors[p + "self_attn.k_proj.weight"] = mat(n_kv, hidden, SCALES["k"])
        tensors[p + "self_attn.v_proj.weight"] = mat(n_kv, hidden, SCALES["v"])
        tensors[p + "self_attn.o_proj.weight"] = mat(hidden, n_q, SCALES["o"])
        tensors[p + "mlp.gate_proj.weight"] = mat(inter, hidden, SCALES["mlp"])
        tensors[p + "mlp.up_proj.weight"] = mat(inter, hidden, SCALES["mlp"])
        tensors[p + "mlp.down_proj.weight"] = mat(hidden, inter, SCALES["mlp"])
        tensors[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    tensors["lm_head.weight"] = mat(VOCAB_SIZE, hidden, SCALES["lm_head"])
    return tensors


def _vocab() -> dict[str, int]:
    vocab = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"t{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)})
    return vocab


def write_tokenizer(out: Path, max_positions: int = CONFIG["max_position_embeddings"]) -> None:
    """A WordLevel tokenizer: word ``t<id>`` is token ``<id>``, so ids and text map 1:1.

    vLLM loads it offline through transformers' fast-tokenizer path
    (tokenizer.json + tokenizer_config.json + special_tokens_map.json).
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_positions,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # Chat completions need a template: the messages' words joined, nothing added, so
        # a chat prompt is the same ids as the completion prompt of the same words.
        "chat_template": CHAT_TEMPLATE,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _write_all(out: Path, max_positions: int = MAX_POSITIONS, shape: str = "tiny") -> None:
    from safetensors.numpy import save_file

    config = _config(max_positions, shape)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    save_file(_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, max_positions)


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != STAMP_FILE
    }


def _is_current(directory: Path, digest: str) -> bool:
    """True when ``directory`` holds the files of the spec hashed ``digest``, unmodified."""
    stamp_path = directory / STAMP_FILE
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("spec_hash") == digest and stamp.get("files") == _file_digests(directory)


def build_model_dir(directory: str | os.PathLike[str], digest: str,
                    write_all: Callable[[Path], None]) -> Path:
    """Write a model with ``write_all`` into ``directory`` (created) and return it.

    Idempotent: a directory whose stamp matches ``digest`` (the spec's hash) and whose
    files still match their recorded digests is reused as is. A stale directory is
    replaced only if it carries our stamp; anything else there is refused, so a
    wrong path never deletes someone's files. The files are built in a sibling
    temporary directory and renamed into place, so a crash never leaves a
    half-written model that later looks valid.
    """
    target = Path(directory)
    if target.exists():
        if _is_current(target, digest):
            return target
        if any(target.iterdir()) and not (target / STAMP_FILE).exists():
            raise FileExistsError(f"{target} is not empty and holds no tiny-model stamp")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_all(tmp)
        stamp = {"spec_hash": digest, "files": _file_digests(tmp)}
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_llama(directory: str | os.PathLike[str],
                     max_positions: int = MAX_POSITIONS, shape: str = "tiny") -> Path:
    """The tiny Llama in ``directory`` (see build_model_dir). ``max_positions``: its
    max_position_embeddings (and the tokenizer's model_max_length), for prompts past
    4096 tokens. Positions are rotary, so the weights, and every output within 4096
    positions, are the same whatever it is; vLLM sizes its rotary cache by it, and a
    prompt past it (allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN) read past the cache.
    ``shape``: one of SHAPES (the module's docstring)."""
    return build_model_dir(directory, spec_hash(max_positions, shape),
                           functools.partial(_write_all, max_positions=max_positions,
                                             shape=shape))


def prompt_ids(seed: int, length: int) -> list[int]:
    """A reproducible prompt of ordinary word ids (no BOS/EOS/UNK), for tests."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return [int(x) for x in rng.integers(FIRST_WORD_ID, VOCAB_SIZE, size=length)]


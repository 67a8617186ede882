"""Guard tests for the whole-engine harness: the tiny model must make KV tests meaningful.

A KV-transfer test passes when the decode engine's output equals a plain
engine's. That proves something only if (1) the output depends on the early
prompt tokens, whose KV is what gets transferred, and (2) the same input gives
the same output, bit for bit, so any difference means wrong KV. This module
checks both on real vLLM engines, and that a prefix-cache hit (the path a
decode engine takes after loading KV: only the last prompt tokens are
computed) gives the same tokens and logprobs as computing the whole prompt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from engine_proc import EngineProc

from kvd.tools.tiny_model.llama import (
    STAMP_FILE,
    build_tiny_llama,
    kv_bytes_per_token,
    prompt_ids,
    spec_hash,
)

pytestmark = pytest.mark.vllm

PROMPT_LEN = 100
CHANGED_PREFIX = 16
GEN_TOKENS = 16
BLOCK_SIZE = 32


def _differ(a: list[int], b: list[int]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def cached_engine(start_engine: Callable[..., EngineProc]) -> Iterator[EngineProc]:
    """A plain engine with prefix caching on, alive next to the reference engine."""
    engine = start_engine("prefix-cached", block_size=BLOCK_SIZE)
    try:
        yield engine
    finally:
        engine.close()


def test_builder_is_idempotent(tmp_path: Path) -> None:
    first = build_tiny_llama(tmp_path / "m")
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert build_tiny_llama(tmp_path / "m") == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes
    assert spec_hash() in (first / STAMP_FILE).read_text()

    # A damaged file is noticed and the model rebuilt.
    (first / "config.json").write_text("{}")
    build_tiny_llama(first)
    assert "LlamaForCausalLM" in (first / "config.json").read_text()

    # A non-empty directory that is not ours is refused, never deleted.
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_llama(other)
    assert (other / "keep.txt").exists()


def test_more_positions_change_only_the_position_limits(tmp_path: Path) -> None:
    """kvd bench vllm's 8K prompts need a model with 8K positions (past them vLLM's
    rotary cache is read out of range); the weights stay the default model's."""
    import json

    default = build_tiny_llama(tmp_path / "d")
    longer = build_tiny_llama(tmp_path / "l", max_positions=8260)
    assert json.loads((longer / "config.json").read_text())["max_position_embeddings"] == 8260
    tok = json.loads((longer / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == 8260
    assert (longer / "model.safetensors").read_bytes() == \
        (default / "model.safetensors").read_bytes()
    assert spec_hash(8260) in (longer / STAMP_FILE).read_text() and spec_hash(8260) != spec_hash()


def test_the_kv_heavy_shape_has_sixteen_times_the_kv_of_a_token(tmp_path: Path) -> None:
    """kvd bench vllm --model-shape kv-heavy: 8 layers of 16 KV heads, the default's
    hidden size and vocabulary; the default model and its hash stay what they were
    (every earlier run and note names it)."""
    import json

    from safetensors.numpy import load_file

    heavy = build_tiny_llama(tmp_path / "h", shape="kv-heavy")
    config = json.loads((heavy / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"],
            config["num_attention_heads"], config["hidden_size"]) == (8, 16, 16, 256)
    weights = load_file(str(heavy / "model.safetensors"))
    assert weights["model.layers.7.self_attn.k_proj.weight"].shape == (16 * 64, 256)
    assert kv_bytes_per_token("kv-heavy") == 16 * kv_bytes_per_token() == 64 << 10
    assert spec_hash(shape="kv-heavy") in (heavy / STAMP_FILE).read_text()
    assert spec_hash(shape="tiny") == spec_hash() == (
        "ea85fa6f3143016fa60d524601d17769e308bb98669e51a838dbc93317cf05ac")
    with pytest.raises(ValueError, match="unknown tiny-model shape"):
        build_tiny_llama(tmp_path / "x", shape="huge")


def test_output_depends_on_the_first_prompt_tokens(
    reference_engine: EngineProc, record_property: pytest.RecordProperty
) -> None:
    record_property("reference_startup_s", round(reference_engine.startup_s, 1))
    base = prompt_ids(1, PROMPT_LEN)
    variants = [prompt_ids(100 + i, CHANGED_PREFIX) + base[CHANGED_PREFIX:] for i in range(4)]
    out = reference_engine.generate([base, *variants], GEN_TOKENS)
    record_property("generate_5x100_s", round(reference_engine.last_generate_s, 3))

    ref = out[0]["token_ids"]
    assert len(ref) == GEN_TOKENS
    # Not a degenerate model that repeats one token whatever the prompt.
    assert len(set(ref)) >= GEN_TOKENS // 2, ref
    diffs = [_differ(ref, r["token_ids"]) for r in out[1:]]
    record_property("differing_tokens", diffs)
    assert all(d >= 12 for d in diffs), f"tokens differing from the base prompt's: {diffs}"
    # No prefix caching on the reference: every prompt token is computed.
    for r in out:
        assert r["prompt_len"] == PROMPT_LEN
        assert r["prompt_tokens_computed"] == PROMPT_LEN
        assert r["first_start"] == 0
        assert r["kv_transfer_params"] is None
        assert len(r["logprobs"]) == GEN_TOKENS
        assert all(lp is not None and lp <= 0.0 for lp in r["logprobs"])


def test_same_prompt_gives_identical_tokens_and_logprobs(reference_engine: EngineProc) -> None:
    prompt = prompt_ids(2, PROMPT_LEN)
    first = reference_engine.generate([prompt], GEN_TOKENS)[0]
    second = reference_engine.generate([prompt], GEN_TOKENS)[0]
    assert first["request_id"] != second["request_id"]
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]

    # In a batch with other prompts the tokens stay the same; logprobs may move
    # by float rounding only (different batch shapes).
    batch = reference_engine.generate([prompt_ids(3, 60), prompt, prompt_ids(4, 140)], GEN_TOKENS)
    assert batch[1]["token_ids"] == first["token_ids"]
    drift = max(abs(a - b) for a, b in zip(batch[1]["logprobs"], first["logprobs"], strict=True))
    assert drift < 1e-4, drift


def test_prefix_cache_hit_matches_full_compute(
    cached_engine: EngineProc,
    reference_engine: EngineProc,
    record_property: pytest.RecordProperty,
) -> None:
    """The decode side of a KV transfer computes only the prompt's tail, like this hit."""
    record_property("cached_startup_s", round(cached_engine.startup_s, 1))
    prompt = prompt_ids(5, PROMPT_LEN)
    full_blocks = PROMPT_LEN // BLOCK_SIZE * BLOCK_SIZE  # 96

    cold = cached_engine.generate([prompt], GEN_TOKENS)[0]
    assert cold["prompt_tokens_computed"] == PROMPT_LEN
    warm = cached_engine.generate([prompt], GEN_TOKENS)[0]
    assert warm["first_start"] == full_blocks
    assert warm["local_cached"] == full_blocks
    assert warm["external_cached"] == 0
    assert warm["prompt_tokens_computed"] == PROMPT_LEN - full_blocks
    assert warm["num_cached_tokens"] == full_blocks

    expected = reference_engine.generate([prompt], GEN_TOKENS)[0]
    assert cold["token_ids"] == expected["token_ids"]
    assert warm["token_ids"] == expected["token_ids"]
    drift = max(abs(a - b) for a, b in zip(warm["logprobs"], expected["logprobs"], strict=True))
    record_property("prefix_hit_logprob_drift", drift)
    assert drift < 1e-4, drift

    assert cached_engine.reset_prefix_cache()
    again = cached_engine.generate([prompt], GEN_TOKENS)[0]
    assert again["prompt_tokens_computed"] == PROMPT_LEN


def test_close_ends_the_process_tree(cached_engine: EngineProc) -> None:
    """close() leaves no EngineCore or worker behind (they share the child's group).

    Runs last in this module: it closes the module's second engine.
    """
    pgid = cached_engine.proc.pid
    t0 = time.monotonic()
    assert cached_engine.close() == 0
    assert time.monotonic() - t0 < 60
    assert cached_engine.close() is None  # idempotent
    deadline = time.monotonic() + 10
    while True:  # exited grandchildren may take a moment to be reaped
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"processes of group {pgid} outlived close()"
        time.sleep(0.2)

"""Whole hybrid (Mamba + attention) vLLM engines through kvd.

A prefill engine and a decode engine on a tiny Nemotron-H ("M*M*": two
Mamba2 layers, two attention layers, real deterministic weights from
tiny_hybrid_model), each with its own ``kvd serve``: vLLM's hybrid allocator
gives two KV-cache groups sharing one tensor per layer position, the
connector registers that pool with kvd in vLLM's LBHNC page order, and the
decode engine pulls the attention blocks and the Mamba state of the request
together. Its greedy tokens and logprobs must equal a plain engine's while it
computes only the last prompt token: the Mamba state after the first N-1
tokens came from kvd (the prefill engine stops one token short, so that the
decode engine has a token to run on that state).

vLLM's CPU build runs Mamba2 only without prefix caching here: with it, the
CPU scan returns no per-chunk states and vLLM's checkpointing fails
(IndexError in MambaMixer2.conv_ssm_forward), so every engine runs with
enable_prefix_caching=False.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_proc import EngineProc
from engine_support import (
    StartEngine,
    daemon_pair,
    prefill_params,
    random_prompts,
    start_plain_pd,
    wait_nothing_held,
)
from tiny_hybrid_models import mamba_matters

from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    yield from daemon_pair(tmp_path_factory, ("hp", "hd"))


@pytest.fixture(scope="module")
def engines(daemons: list[DaemonProcess], start_engine: StartEngine, tiny_hybrid_dir: Path
            ) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    """Prefill, decode (each on its daemon) and a plain engine, all on the hybrid model."""
    yield from start_plain_pd(start_engine, daemons, "hybrid", tiny_hybrid_dir)


def test_plain_hybrid_model_depends_on_the_whole_prompt(engines: tuple[EngineProc, ...]) -> None:
    """The guard: without it, equal outputs below could mean the state was ignored."""
    _, _, plain = engines
    base = random_prompts(1, 150, seed=51)[0]
    early = random_prompts(1, 16, seed=52)[0] + base[16:]  # only the first 16 tokens differ
    outs = plain.generate([base, early, base], max_tokens=MAX_TOKENS)
    assert outs[0]["token_ids"] == outs[2]["token_ids"], "plain engine is not deterministic"
    differ = sum(a != b for a, b in zip(outs[0]["token_ids"], outs[1]["token_ids"], strict=True))
    assert differ >= MAX_TOKENS // 2, (outs[0]["token_ids"], outs[1]["token_ids"])


def test_the_prefix_reaches_the_output_through_the_mamba_state(tiny_hybrid_dir: Path) -> None:
    """Attention outputs zeroed (transformers' NemotronH forward), the first 16 of 150
    tokens still move the logits; with the Mamba outputs zeroed too, nothing does."""
    assert mamba_matters(tiny_hybrid_dir) > 0.05
    assert mamba_matters(tiny_hybrid_dir, zero_mamba=True) == 0.0


def test_hybrid_decode_through_kvd_equals_a_plain_engine(
        engines: tuple[EngineProc, ...], daemons: tuple[DaemonProcess, ...]) -> None:
    prefill, decode, plain = engines
    _, dd = daemons
    prompts = random_prompts(3, 150, seed=61) + [random_prompts(1, 700, seed=62)[0]]
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    nbytes0 = dd.metric("kvd_transferred_bytes_total", role="consumer")
    params = prefill_params(prefill, prompts)
    # one block list per KV-cache group: Mamba (the running slot), full attention
    assert all(len(p["remote_block_ids"]) == 2 for p in params), params
    got = decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    moved = dd.metric("kvd_transferred_bytes_total", role="consumer") - nbytes0
    for p, w, g in zip(prompts, want, got, strict=True):
        assert g["token_ids"] == w["token_ids"], "hybrid decode through kvd diverged from plain"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        # Only the last prompt token ran on the decode engine: the attention KV of the
        # first N-1 tokens and the Mamba state after them came from kvd.
        assert g["prompt_tokens_computed"] == 1, g
        assert g["first_start"] == len(p) - 1, g
    assert moved > 0


def test_hybrid_daemons_hold_nothing_once_the_engines_are_done(
        engines: tuple[EngineProc, ...], daemons: tuple[DaemonProcess, ...]) -> None:
    prefill, decode, _ = engines
    prefill.generate(random_prompts(1, 40, seed=71), max_tokens=2)
    decode.generate(random_prompts(1, 40, seed=72), max_tokens=2)
    pd, dd = daemons
    wait_nothing_held(pd, dd)
    assert pd.metric("kvd_transfers_total", role="producer", outcome="ok") >= 4
    assert pd.metric("kvd_leases_expired_total") == 0

"""Whole hybrid engines of every family vLLM's CPU build runs, through two ``kvd serve``.

One tiny model per family, built with transformers' own classes
(tiny_hybrid_models): GraniteMoeHybrid (Granite 4.0-H: Mamba2 and attention
layers), Falcon-H1 (attention and Mamba2 side by side in every layer: one layer
in two groups), Zamba2 (a shared attention block over its own caches, Mamba2 in
two groups) and attention-free Mamba2. (Nemotron-H: test_engine_hybrid.py.)
The connector reads their geometry from vLLM's objects only; no family's config
names appear in kvd. For each: the guard (with every attention output zeroed,
the first 16 tokens still change the logits: the prompt reaches the output
through the Mamba state kvd moves), a plain engine that depends on the whole
prompt, and a decode engine that loads everything but the last prompt token
from kvd and must give the plain engine's tokens and logprobs while computing
one prompt token.

Every engine runs without prefix caching (the CPU build's Mamba kernels need
that, see test_engine_hybrid.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_proc import EngineProc
from engine_support import StartEngine, daemon_pair, random_prompts, start_plain_pd
from tiny_hybrid_models import build_tiny_family, mamba_matters

from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ["granitemoehybrid", "falcon_h1", "mamba2", "zamba2"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    yield from daemon_pair(tmp_path_factory, ("fp", "fd"))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[str, Path]:
    name = request.param
    return name, build_tiny_family(name, tmp_path_factory.getbasetemp() / f"tiny-{name}")


@pytest.fixture(scope="module")
def engines(family: tuple[str, Path], daemons: list[DaemonProcess],
            start_engine: StartEngine) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    """Prefill, decode (each on its daemon) and a plain engine of one family."""
    name, model_dir = family
    yield from start_plain_pd(start_engine, daemons, name, model_dir)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return random_prompts(n, length, seed, step=37)


def test_the_prefix_reaches_the_output_through_the_mamba_state(family: tuple[str, Path]
                                                                ) -> None:
    """The guard: attention zeroed, the first 16 of 150 tokens still move the logits, so a
    decode that got the attention KV but not the Mamba state could not match."""
    _, model_dir = family
    assert mamba_matters(model_dir) > 0.05
    # the control: the Mamba outputs zeroed as well, nothing carries the prefix
    assert mamba_matters(model_dir, zero_mamba=True) == 0.0


def test_decode_through_kvd_equals_a_plain_engine(
        family: tuple[str, Path], engines: tuple[EngineProc, ...],
        daemons: tuple[DaemonProcess, ...]) -> None:
    prefill, decode, plain = engines
    _, dd = daemons
    base = _prompts(1, 150, seed=81)[0]
    early = _prompts(1, 16, seed=82)[0] + base[16:]  # only the first 16 tokens differ
    prompts = [base, early, _prompts(1, 300, seed=83)[0]]
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    differ = sum(a != b for a, b in zip(want[0]["token_ids"], want[1]["token_ids"],
                                        strict=True))
    assert differ >= MAX_TOKENS // 2, ("plain engine ignores the prompt's start",
                                       want[0]["token_ids"], want[1]["token_ids"])
    nbytes0 = dd.metric("kvd_transferred_bytes_total", role="consumer")
    first = prefill.generate(prompts, max_tokens=1,
                             kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))
    params = [r["kv_transfer_params"] for r in first]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    got = decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    for p, w, g in zip(prompts, want, got, strict=True):
        assert g["token_ids"] == w["token_ids"], f"{family[0]}: decode through kvd diverged"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        assert g["prompt_tokens_computed"] == 1, g
        assert g["first_start"] == len(p) - 1, g
    assert dd.metric("kvd_transferred_bytes_total", role="consumer") > nbytes0

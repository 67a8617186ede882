"""Whole vLLM engines through kvd: a prefill engine and a decode engine, each with its
own ``kvd serve``, must produce exactly what one plain engine produces, while the
decode engine computes only the last prompt token.

The tiny model is real (deterministic weights whose outputs depend on the
prompt, guarded by test_tiny_model.py), so equal tokens and logprobs mean the
decode engine attended over the pulled KV, not over zeros or stale blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_proc import EngineProc
from engine_support import (
    BLOCK,
    StartEngine,
    daemon_pair,
    prefill_outputs,
    random_prompts,
    start_pd,
    wait_nothing_held,
)

from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    yield from daemon_pair(tmp_path_factory, ("vp", "vd"))


@pytest.fixture(scope="module")
def engines(daemons: list[DaemonProcess], start_engine: StartEngine,
            reference_engine: EngineProc) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    """Prefill and decode engines on their own daemons, and the plain reference engine."""
    for prefill, decode in start_pd(start_engine, daemons, ("prefill", "decode")):
        yield prefill, decode, reference_engine


def test_engine_workers_are_not_pinned_to_one_core(engines: tuple[EngineProc, ...]) -> None:
    """vLLM's CPU backend pins every engine's worker (and each thread it starts) to the
    cores of local rank 0, the same for every engine of a host. Pinned together, a
    prefill worker stepping without a pause starved the decode worker for ~30 s, past
    the prefill leases (engine_proc.BASE_ENV). Every thread may use every core here."""
    cpus = os.sched_getaffinity(0)
    for engine in engines:
        workers = engine.worker_pids()
        assert workers, f"{engine.name}: no VLLM::Worker process found"
        for pid in workers:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    allowed = os.sched_getaffinity(int(tid))
                except OSError:  # the thread ended meanwhile
                    continue
                assert allowed == cpus, (f"{engine.name}: worker {pid} thread {tid} is pinned "
                                         f"to CPUs {sorted(allowed)} of {sorted(cpus)}")


def _disaggregated(
    prefill: EngineProc, decode: EngineProc, prompts: list[list[int]]
) -> tuple[list[dict], list[dict]]:
    """The router's job, as vLLM's toy proxy does it: prefill with max_tokens=1 and
    do_remote_decode, then decode with the prefill response's params copied over."""
    first, params = prefill_outputs(prefill, prompts)
    return first, decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params)


def test_decode_through_kvd_equals_a_plain_engine(engines: tuple[EngineProc, ...]) -> None:
    prefill, decode, plain = engines
    prompts = random_prompts(3, 150, seed=11)
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    first, got = _disaggregated(prefill, decode, prompts)
    for p, w, f, g in zip(prompts, want, first, got, strict=True):
        assert f["token_ids"] == w["token_ids"][:1]
        assert g["token_ids"] == w["token_ids"], "decode through kvd diverged from plain"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        # The decode engine computed only the last prompt token; the rest came from kvd.
        assert g["prompt_tokens_computed"] == 1, g
        assert g["external_cached"] == len(p) - 1 or g["first_start"] == len(p) - 1, g


def test_prefix_hit_on_decode_pulls_only_the_tail(engines: tuple[EngineProc, ...]) -> None:
    prefill, decode, plain = engines
    shared = random_prompts(1, 4 * BLOCK, seed=21)[0]
    # Warm the decode engine's prefix cache with the first 4 blocks (a plain request).
    decode.generate([shared + [7] * 5], max_tokens=1)
    prompt = shared + random_prompts(1, 70, seed=22)[0]
    want = plain.generate([prompt], max_tokens=MAX_TOKENS)[0]
    _, got = _disaggregated(prefill, decode, [prompt])
    assert got[0]["token_ids"] == want["token_ids"]
    assert got[0]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    assert got[0]["prompt_tokens_computed"] == 1


def test_long_prompt_pull_moves_exactly_the_prompt_blocks(
        engines: tuple[EngineProc, ...], daemons: tuple[DaemonProcess, ...],
        tiny_model_dir: Path) -> None:
    """kvd's own /metrics count the same bytes vLLM's connector moved: every prompt block."""
    prefill, decode, plain = engines
    _, dd = daemons
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg["torch_dtype"]]
    block_nbytes = (cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
                    * 2 * elem * BLOCK)
    prompt = random_prompts(1, 3500, seed=41)[0]
    want = plain.generate([prompt], max_tokens=MAX_TOKENS)[0]
    nbytes0 = dd.metric("kvd_transferred_bytes_total", role="consumer")
    seconds0 = dd.metric("kvd_transfer_duration_seconds_sum", role="consumer")
    _, got = _disaggregated(prefill, decode, [prompt])
    nbytes = dd.metric("kvd_transferred_bytes_total", role="consumer") - nbytes0
    seconds = dd.metric("kvd_transfer_duration_seconds_sum", role="consumer") - seconds0
    assert got[0]["token_ids"] == want["token_ids"]
    assert got[0]["prompt_tokens_computed"] == 1
    assert nbytes == -(-len(prompt) // BLOCK) * block_nbytes
    print(f"\nlong-prompt pull: {len(prompt)} tokens, {nbytes / 1e6:.1f} MB in "
          f"{seconds * 1e3:.1f} ms = {nbytes / seconds / 1e9:.2f} GB/s (pull accepted -> done)")


def test_daemons_hold_nothing_once_the_engines_are_done(
        engines: tuple[EngineProc, ...], daemons: tuple[DaemonProcess, ...]) -> None:
    """Every published prefill was read and released; no pull is left in flight."""
    prefill, decode, _ = engines
    # One more step on each engine lets the rank-0 workers report their last events.
    prefill.generate(random_prompts(1, 40, seed=31), max_tokens=2)
    decode.generate(random_prompts(1, 40, seed=32), max_tokens=2)
    pd, dd = daemons
    wait_nothing_held(pd, dd)
    assert pd.metric("kvd_transfers_total", role="producer", outcome="ok") >= 3
    assert pd.metric("kvd_leases_expired_total") == 0

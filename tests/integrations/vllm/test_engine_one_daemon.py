"""Whole vLLM engines on ONE ``kvd serve`` (the node-level shape): a prefill and a
decode engine of the same host register with the same daemon, and the decode engine's
pulls are local copies inside it (no NIXL, no network). Tokens and logprobs must equal
a plain engine's, the decode engine computing only the last prompt token; a hybrid
(Mamba + attention) model likewise. The two-daemon shape is test_engine_pd.py and
test_engine_hybrid.py (same folder).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_proc import EngineProc
from engine_support import (
    StartEngine,
    one_daemon,
    prefill_outputs,
    prefill_params,
    random_prompts,
    start_pd,
    start_plain_pd,
    wait_nothing_held,
)

from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    yield from one_daemon(tmp_path_factory, "v1")


@pytest.fixture(scope="module")
def engines(daemons: list[DaemonProcess], start_engine: StartEngine,
            reference_engine: EngineProc) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    for prefill, decode in start_pd(start_engine, daemons, ("prefill", "decode")):
        yield prefill, decode, reference_engine


def test_decode_on_the_same_daemon_equals_a_plain_engine(
        engines: tuple[EngineProc, ...], daemons: list[DaemonProcess]) -> None:
    prefill, decode, plain = engines
    d = daemons[0]
    local0 = d.metric("kvd_transfers_total", role="consumer", path="local", outcome="ok")
    prompts = random_prompts(3, 150, seed=11)
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    first, params = prefill_outputs(prefill, prompts)
    got = decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    for w, f, g in zip(want, first, got, strict=True):
        assert f["token_ids"] == w["token_ids"][:1]
        assert g["token_ids"] == w["token_ids"], "decode through one kvd diverged from plain"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        assert g["prompt_tokens_computed"] == 1, g
    local = d.metric("kvd_transfers_total", role="consumer", path="local", outcome="ok")
    assert local - local0 == len(prompts), "the pulls did not take the local path"
    assert d.metric("kvd_transfers_total", role="consumer", path="remote") == 0
    prefill.generate(random_prompts(1, 40, seed=31), max_tokens=2)
    decode.generate(random_prompts(1, 40, seed=32), max_tokens=2)
    wait_nothing_held(d, d)
    assert d.metric("kvd_leases_expired_total") == 0


@pytest.fixture(scope="module")
def hybrid_engines(daemons: list[DaemonProcess], start_engine: StartEngine,
                   tiny_hybrid_dir: Path) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    yield from start_plain_pd(start_engine, daemons, "hybrid1", tiny_hybrid_dir)


def test_hybrid_decode_on_the_same_daemon_equals_a_plain_engine(
        hybrid_engines: tuple[EngineProc, ...], daemons: list[DaemonProcess]) -> None:
    prefill, decode, plain = hybrid_engines
    d = daemons[0]
    local0 = d.metric("kvd_transfers_total", role="consumer", path="local", outcome="ok")
    prompts = random_prompts(3, 150, seed=61)
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    params = prefill_params(prefill, prompts)
    got = decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    for p, w, g in zip(prompts, want, got, strict=True):
        assert g["token_ids"] == w["token_ids"], "hybrid decode through one kvd diverged"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        assert g["prompt_tokens_computed"] == 1, g
        assert g["first_start"] == len(p) - 1, g
    assert d.metric("kvd_transfers_total", role="consumer", path="local",
                    outcome="ok") - local0 == len(prompts)

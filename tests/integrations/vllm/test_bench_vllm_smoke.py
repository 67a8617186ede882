"""``kvd bench vllm`` as a smoke run: real engines, a plain one and kvd on one daemon
and on two, a few rounds and a batch. Judged here: correctness (every token equal to
the plain engine's, the decode engine loading the prompt rather than computing it,
bytes moved) and the batch rule (a batch's hand-overs land within one decode step of
each other). Timing targets are the benchmark's to judge, not a test's.
"""

from __future__ import annotations

import pytest

from kvd.tools.bench.vllm_run import BenchConfig, run_bench, session_pids

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

SYSTEMS = ("plain", "kvd-1d", "kvd-2d")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cfg = BenchConfig(systems=SYSTEMS, rounds=3, batch=6, batch_rounds=2, prompt_tokens=800,
                      max_tokens=8, idle_s=2.0)
    return run_bench(cfg, str(tmp_path_factory.mktemp("bench-vllm")))


def _summary(result: dict, system: str) -> dict:
    return next(s for s in result["summaries"] if s["system"] == system)


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_token_equals_the_plain_engines(result: dict, system: str) -> None:
    equal, compared = map(int, _summary(result, system)["tokens_equal"].split("/"))
    assert compared > 0 and equal == compared


@pytest.mark.parametrize("system", SYSTEMS[1:])
def test_the_decode_loads_the_prompt_through_kvd(result: dict, system: str) -> None:
    s = _summary(result, system)
    assert s["decode_loaded_tokens_per_request"] >= 700  # of an 800-token prompt
    assert s["decode_computed_tokens_per_request"] <= 1
    assert s["bytes_per_request"] > 0


@pytest.mark.parametrize("system", SYSTEMS[1:])
def test_a_batch_lands_within_one_decode_step(result: dict, system: str) -> None:
    batches = [b for b in result["batches"] if b["system"] == system]
    assert len(batches) == 2
    for b in batches:
        spread_s = max(b["first_token_s"]) - min(b["first_token_s"])
        gaps = sorted(b["step_gaps_s"])
        step_s = gaps[len(gaps) // 2]
        assert spread_s <= step_s, (
            f"{system}: the batch's first tokens spread over {spread_s * 1000:.1f} ms, "
            f"more than one decode step ({step_s * 1000:.1f} ms)")


def test_nothing_is_left_running(result: dict) -> None:
    # run_bench stopped every session it started (engines, daemons, routers)
    assert result["host"]["cpus"] >= 1
    assert all(not session_pids(pid) for pid in result.get("started_sessions", []))

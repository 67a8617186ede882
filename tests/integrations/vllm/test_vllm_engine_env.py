"""The environment the whole-engine vLLM tests give each engine (engine_proc.py, beside
this file).

engine_proc is standard library only, so its environment is checked here, in the default
suite (these tests carry no ``vllm`` marker); test_engine_pd.py checks the engines' real
thread affinities.
"""

from __future__ import annotations

from pathlib import Path

import engine_proc


def test_engines_run_unpinned_whatever_the_parent_environment_says() -> None:
    """vLLM's CPU backend pins every engine's worker to the same core by default; a busy
    prefill worker then starved the decode worker past the prefill leases (P/D tests
    failed about one run in two)."""
    env = engine_proc.engine_environment({"VLLM_CPU_OMP_THREADS_BIND": "auto",
                                          "OMP_NUM_THREADS": "8", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PATH"] == "/bin"


def test_a_caller_may_still_choose_a_binding(tmp_path: Path) -> None:
    env = engine_proc.engine_environment({"PYTHONPATH": "/x"}, {"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                sched_log=tmp_path / "s.jsonl")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["PYTHONPATH"] == f"{engine_proc.HERE}:/x"
    assert env["KVD_TEST_SCHED_LOG"] == str(tmp_path / "s.jsonl")


def test_the_issue_25_reproduction_takes_vllms_default_binding_back() -> None:
    """KVD_TEST_VLLM_CPU_BIND=auto: engines as vLLM starts them by default (pinned)."""
    env = engine_proc.engine_environment({"KVD_TEST_VLLM_CPU_BIND": "auto", "PATH": "/bin"})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env
    env = engine_proc.engine_environment({"KVD_TEST_VLLM_CPU_BIND": "auto", "OMP_NUM_THREADS": "2"})
    assert env["OMP_NUM_THREADS"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" not in env
    env = engine_proc.engine_environment({"KVD_TEST_VLLM_CPU_BIND": "0-1"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "1"

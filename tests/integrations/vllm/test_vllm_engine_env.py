"""The environment the whole-engine vLLM tests give each engine (tests/vllm/engine_proc.py).

engine_proc is standard library only, so its environment is checked here, in the default
suite; tests/vllm/test_engine_pd.py checks the engines' real thread affinities.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ENGINE_PROC = Path(__file__).resolve().parents[1] / "vllm" / "engine_proc.py"


def _engine_proc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvd_test_engine_proc", ENGINE_PROC)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engines_run_unpinned_whatever_the_parent_environment_says() -> None:
    """vLLM's CPU backend pins every engine's worker to the same core by default; a busy
    prefill worker then starved the decode worker past the prefill leases (P/D tests
    failed about one run in two)."""
    env = _engine_proc().engine_environment({"VLLM_CPU_OMP_THREADS_BIND": "auto",
                                             "OMP_NUM_THREADS": "8", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PATH"] == "/bin"


def test_a_caller_may_still_choose_a_binding(tmp_path: Path) -> None:
    ep = _engine_proc()
    env = ep.engine_environment({"PYTHONPATH": "/x"}, {"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                sched_log=tmp_path / "s.jsonl")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["PYTHONPATH"] == f"{ENGINE_PROC.parent}:/x"
    assert env["KVD_TEST_SCHED_LOG"] == str(tmp_path / "s.jsonl")


def test_the_issue_25_reproduction_takes_vllms_default_binding_back() -> None:
    """KVD_TEST_VLLM_CPU_BIND=auto: engines as vLLM starts them by default (pinned)."""
    ep = _engine_proc()
    env = ep.engine_environment({"KVD_TEST_VLLM_CPU_BIND": "auto", "PATH": "/bin"})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env
    env = ep.engine_environment({"KVD_TEST_VLLM_CPU_BIND": "auto", "OMP_NUM_THREADS": "2"})
    assert env["OMP_NUM_THREADS"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" not in env
    env = ep.engine_environment({"KVD_TEST_VLLM_CPU_BIND": "0-1"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "1"

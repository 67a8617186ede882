"""No engine step waits on a daemon, driven by vLLM's real scheduler.

A frozen daemon (SIGSTOP) takes messages into its socket buffers and answers none.
Once, the scheduler connector made a blocking round trip to it inside the
step (the pull in build_connector_meta, the publish in request_finished), so the whole
engine, plain requests included, stood still for up to the 10 s request timeout per
call. Here every connector hook vLLM calls in its step is timed while the daemon is
frozen, plain requests must finish during the freeze, and the remote ones must finish
with the prefill's bytes once the daemon resumes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

import hook_timing  # noqa: E402
from hook_timing import HookTimes, check_hooks  # noqa: E402
from pd_support import (  # noqa: E402
    DAEMON_ARGS,
    PROMPT,
    PROMPT_TOKENS,
    MakeEngine,
    OwnDaemons,
    check_pulled,
    generated,
)
from scheduler_support import (  # noqa: E402
    SAMPLED_TOKEN,
    drain,
    kill_daemon,
    prefill,
    prompt_tokens,
    run_until,
    stop_daemon,
)

from kvd.tools.localcluster import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

hook_times = hook_timing.hook_times
FREEZE_S = 4.0


def _check_hooks(times: HookTimes) -> None:
    check_hooks(times, "with a daemon frozen", min_n=20)
    print(f"\n{times.table()}")


def _freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def test_decode_daemon_frozen_plain_requests_run_and_remote_ones_finish_after(
        engines: MakeEngine, own_daemons: OwnDaemons, hook_times: HookTimes) -> None:
    p_daemon, d_daemon = own_daemons(DAEMON_ARGS)
    p = engines("prefill", p_daemon)
    d = engines("decode", d_daemon)
    params = {rid: prefill(p, rid, PROMPT_TOKENS) for rid in ("req-a", "req-b")}
    hook_times.clear()
    _freeze(d_daemon.proc.pid)
    frozen_at = time.monotonic()
    try:
        for rid in ("req-a", "req-b"):
            d.add(f"dec-{rid}", PROMPT_TOKENS, max_tokens=3,
                  kv_transfer_params=params[rid])
        d.add("plain", prompt_tokens(7, 40), max_tokens=3)
        run_until([p, d], lambda: d.finished("plain"), timeout_s=FREEZE_S,
                  what="the plain request to finish while D's daemon is frozen")
        assert generated(d, "plain") == [SAMPLED_TOKEN] * 3
        steps_frozen = len(d.step_s)
        run_until([p, d], lambda: time.monotonic() - frozen_at > FREEZE_S,
                  timeout_s=FREEZE_S + 5, what="the freeze to last")
        longest_step = max(d.step_s[-(len(d.step_s) - steps_frozen + 1):])
        assert not d.received, "nothing can be received while the daemon is frozen"
    finally:
        _thaw(d_daemon.proc.pid)
    _check_hooks(hook_times)
    print(f"longest decode step while frozen: {longest_step * 1000:.2f} ms")
    assert longest_step < 0.5
    for rid in ("req-a", "req-b"):
        run_until([p, d], lambda r=rid: d.finished(f"dec-{r}"), timeout_s=20,
                  what=f"dec-{rid} to finish after the thaw")
        check_pulled(d, f"dec-{rid}", p, 0, PROMPT)
        assert generated(d, f"dec-{rid}") == [SAMPLED_TOKEN] * 3
    drain([p, d], timeout_s=20)
    assert p.stat("sends_ok") == 2


def test_prefill_daemon_frozen_request_finished_returns_at_once_then_decode_reads(
        engines: MakeEngine, own_daemons: OwnDaemons, hook_times: HookTimes) -> None:
    """request_finished returns the kv_transfer_params (receipt included) with the
    prefill daemon frozen; the Publish waits in the socket and the pull succeeds once the
    daemon resumes, the consumer's Acquire and the Publish arriving in either order."""
    p_daemon, d_daemon = own_daemons(DAEMON_ARGS)
    p = engines("prefill", p_daemon)
    d = engines("decode", d_daemon)
    hook_times.clear()
    _freeze(p_daemon.proc.pid)
    try:
        params = prefill(p, "req-f", PROMPT_TOKENS, timeout_s=FREEZE_S)
        assert params.get("kvd_receipt", "").count("/") == 1, params
        _check_hooks(hook_times)
    finally:
        _thaw(p_daemon.proc.pid)
    d.add("dec-f", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
    run_until([p, d], lambda: d.finished("dec-f"), timeout_s=20, what="dec-f to end")
    check_pulled(d, "dec-f", p, 0, PROMPT)
    drain([p, d], timeout_s=20)


def test_prefill_daemon_frozen_then_killed_every_request_is_answered(
        engines: MakeEngine, own_daemons: OwnDaemons) -> None:
    """The decode's pull goes to a frozen prefill daemon, which is then killed: with
    "recompute" the decode computes the prompt itself and answers; the time from the
    kill to the answer is printed (handshake_timeout_s is 2 s here)."""
    p_daemon, d_daemon = own_daemons(DAEMON_ARGS)
    p = engines("prefill", p_daemon, extra={"kvd_request_timeout_s": 1.0})
    d = engines("decode", d_daemon, failure_policy="recompute")
    params = prefill(p, "req-k", PROMPT_TOKENS)
    _freeze(p_daemon.proc.pid)
    d.add("dec-k", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
    d.add("plain", prompt_tokens(8, 40), max_tokens=2)
    run_until([p, d], lambda: d.finished("plain"), timeout_s=5, what="plain request")
    kill_daemon(p_daemon)
    killed_at = time.monotonic()
    run_until([d], lambda: d.finished("dec-k"), timeout_s=20,
              what="the decode to be answered after P's daemon died")
    answered_s = time.monotonic() - killed_at
    print(f"prefill daemon kill -> decode answered: {answered_s:.2f} s")
    out = d.finished("dec-k")
    assert out is not None and out.finish_reason is not None
    assert out.finish_reason.name == "LENGTH", out
    assert generated(d, "dec-k") == [SAMPLED_TOKEN] * 2
    assert d.kv_mismatches(d.blocks_seen["dec-k"], 0, PROMPT, d.tag) == 0
    assert answered_s < 2.0 + 1.0 + 1.0, answered_s  # handshake timeout + 1 s + slack
    drain([d], timeout_s=20)


@pytest.mark.parametrize("backing", ["shm", "memfd"])
def test_decode_daemon_restart_fails_pulls_in_flight_at_once_then_pd_resumes(
        backing: str, engines: MakeEngine, own_daemons: OwnDaemons, tmp_path: Path) -> None:
    """D's daemon is killed with a pull in flight and a new one starts on the same
    address: the worker hears a new incarnation and fails the pull within a step
    (recompute: the request is answered), rather than after kvd_pull_timeout_s. Then
    the worker registers again in the background, the new daemon
    adopts the pool the engine kept, the scheduler hears the new instance, and a new
    request goes P->D through the new daemon, byte-exact, with no engine restart. Both
    pool kinds a restarted daemon adopts: a file in shm_dir, and a memfd the worker
    hands back through its own fd (kvd.pool.adopt)."""
    args = [*DAEMON_ARGS, "--set", f"pool_backing={backing}"]
    p_daemon, d_daemon = own_daemons(args)
    restarted = None
    try:
        p = engines("prefill", p_daemon)
        d = engines("decode", d_daemon, failure_policy="recompute")
        params = prefill(p, "req-r", PROMPT_TOKENS)
        _freeze(d_daemon.proc.pid)  # the pull stays in flight there
        d.add("dec-r", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
        run_until([p, d], lambda: len(d.step_s) > 3, what="a few decode steps")
        # A crash: no cleanup, and the engine's pool file is not removed by the test.
        os.kill(d_daemon.proc.pid, signal.SIGKILL)
        d_daemon.proc.wait(10)
        old_instance = d.connector._scheduler.daemon_instance
        # The same configuration (name -> shm_prefix), as a restarted sidecar has.
        restarted = DaemonProcess.start(d_daemon.name, tmp_path / "again", args,
                                        metrics=False, engine_address=d_daemon.engine_address,
                                        peer_address=d_daemon.peer_address)
        start = time.monotonic()
        run_until([p, d], lambda: d.finished("dec-r"), timeout_s=20,
                  what="the decode to be answered after its daemon restarted")
        print(f"decode daemon restart -> failed pull answered: "
              f"{time.monotonic() - start:.2f} s")
        assert d.received["dec-r"].failed
        slowest = max(d.step_s)
        assert slowest < 0.5, f"a decode step took {slowest:.2f} s (it waited on the daemon)"

        # P/D resumes through the new daemon: no engine restart, the same KV memory.
        run_until([p, d], lambda: all(w._worker.rejoin.rejoined for w in d.workers),
                  timeout_s=20, what="the workers to register again (in the background)")
        rejoined_s = time.monotonic() - start
        assert all(w._worker.rejoin.rejoined == 1 for w in d.workers)
        fresh = prompt_tokens(11, PROMPT)  # not dec-r's prompt: no local prefix hit on D
        params2 = prefill(p, "req-r2", fresh)
        d.add("dec-r2", fresh, max_tokens=2, kv_transfer_params=params2)
        run_until([p, d], lambda: d.finished("dec-r2"), timeout_s=20,
                  what="a P->D request through the new daemon")
        first_pd_s = time.monotonic() - start
        check_pulled(d, "dec-r2", p, 0, PROMPT)
        assert generated(d, "dec-r2") == [SAMPLED_TOKEN] * 2
        assert d.connector._scheduler.daemon_instance not in ("", old_instance), \
            "the scheduler never heard of the new daemon instance"
        if backing == "memfd":
            assert all(w._worker.handle.pool.handle.directory
                       == f"/proc/{restarted.proc.pid}/fd" for w in d.workers)
        print(f"[{backing}] decode daemon restart -> workers registered again: "
              f"{rejoined_s:.2f} s, "
              f"-> first P->D request through it: {first_pd_s:.2f} s")
        assert max(d.step_s) < 0.5, "a step waited on the re-registration"
        drain([p, d], timeout_s=30)
    finally:  # the crashed daemon's leftovers go first: the restarted one has its name,
        # and its stop checks that nothing under that name is left
        kill_daemon(d_daemon)
        if restarted is not None:
            stop_daemon(restarted)

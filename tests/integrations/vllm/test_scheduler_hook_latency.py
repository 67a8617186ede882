"""Every connector hook in vLLM's step returns within 1 ms whatever the daemon does
(within 1 ms each), driven by vLLM's real scheduler against real daemons.

Both daemons are made slow (stopped 50 ms of every 100 ms), frozen (SIGSTOP), dead
(SIGKILL) or restarting (SIGKILL, then a new incarnation on the same addresses 1 s
later, which adopts the engines' pools) while the engines keep taking requests: remote
decodes, plain requests and new prefills (whose request_finished publishes). Each
hook's p99 must be within 1 ms; n, p50, p99 and max are printed per hook (``-s``).
A single call over 1 ms must owe it to the host, not to kvd: its own CPU time within
1 ms, the rest spent on the OS run queue or asleep (hook_timing splits it). On this
shared 2-core host a Python thread loses its core for milliseconds now and then
(several test suites run beside this one), which no code can prevent.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

import hook_timing  # noqa: E402
from hook_timing import HookTimes, check_hooks  # noqa: E402
from pd_support import DAEMON_ARGS, PROMPT, MakeEngine, OwnDaemons  # noqa: E402
from scheduler_support import (  # noqa: E402
    prefill,
    prompt_tokens,
)

from kvd.tools.localcluster import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

hook_times = hook_timing.hook_times

WINDOW_S = 4.0  # how long the daemons misbehave while the engines step
ROUND_S = 0.4  # a new decode, plain request and prefill this often
ARGS = [*DAEMON_ARGS, "--set", "pool_backing=shm"]  # adoptable after a restart


class Fault:
    """What the daemons do during the window."""

    def __init__(self, kind: str, daemons: list[DaemonProcess], tmp_path: Path) -> None:
        self.kind = kind
        self.daemons = daemons
        self.tmp_path = tmp_path
        self.restarted: list[DaemonProcess] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _signal(self, sig: int) -> None:
        for d in self.daemons:
            if d.proc.poll() is None:
                os.kill(d.proc.pid, sig)

    def _slow(self) -> None:
        while not self._stop.is_set():
            self._signal(signal.SIGSTOP)
            time.sleep(0.05)
            self._signal(signal.SIGCONT)
            self._stop.wait(0.05)

    def _restart(self) -> None:
        self._stop.wait(1.0)
        for d in self.daemons:
            self.restarted.append(DaemonProcess.start(
                d.name, self.tmp_path / f"again-{d.name}", ARGS, metrics=False,
                engine_address=d.engine_address, peer_address=d.peer_address))

    def start(self) -> None:
        if self.kind == "frozen":
            self._signal(signal.SIGSTOP)
        elif self.kind in ("dead", "restarting"):
            self._signal(signal.SIGKILL)  # a crash: the pool files stay for adoption
            for d in self.daemons:
                d.proc.wait(10)
        if self.kind in ("slow", "restarting"):
            self._thread = threading.Thread(
                target=self._slow if self.kind == "slow" else self._restart, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        if self.kind in ("slow", "frozen"):
            self._signal(signal.SIGCONT)


@pytest.mark.parametrize("kind", ["slow", "frozen", "dead", "restarting"])
def test_every_step_hook_returns_within_1ms_whatever_the_daemon_does(
        kind: str, engines: MakeEngine, tmp_path: Path,
        own_daemons: OwnDaemons, hook_times: HookTimes) -> None:
    p_daemon, d_daemon = daemons = own_daemons(ARGS)
    extra = {"kvd_request_timeout_s": 1.0}
    p = engines("prefill", p_daemon, extra=extra, num_blocks=256)
    d = engines("decode", d_daemon, failure_policy="recompute", extra=extra,
                num_blocks=256)
    rounds = int(WINDOW_S / ROUND_S)
    params = [prefill(p, f"early-{k}", prompt_tokens(100 + k, PROMPT)) for k in range(rounds)]
    fault = Fault(kind, list(daemons), tmp_path)
    hook_times.clear()
    fault.start()
    try:
        t0 = time.monotonic()
        k = 0
        while (now := time.monotonic() - t0) < WINDOW_S:
            if k < rounds and now >= k * ROUND_S:
                d.add(f"dec-{k}", prompt_tokens(100 + k, PROMPT), max_tokens=20,
                      kv_transfer_params=params[k])
                d.add(f"plain-{k}", prompt_tokens(200 + k, 40), max_tokens=20)
                p.add(f"pre-{k}", prompt_tokens(300 + k, PROMPT), max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})
                k += 1
            p.step()
            d.step()
            time.sleep(0.002)
    finally:
        fault.stop()
        for again in fault.restarted:
            own_daemons.end_also(again)  # stopped (and checked clean) by the fixture
    steps = sum(len(c) for c in hook_times.calls.values())
    print(f"\ndaemons {kind} for {WINDOW_S:.0f} s: {steps} hook calls, "
          f"{len(hook_times.slow())} over 1 ms\n{hook_times.table()}")
    print(f"engine steps in the window: {len(hook_times.calls['build_connector_meta'])}")
    check_hooks(hook_times, f"with the daemons {kind}")
    assert (hook_times.calls["request_finished"]
            or hook_times.calls["request_finished_all_groups"]), "no prefill finished"
    assert hook_times.calls["update_state_after_alloc"], "no decode was scheduled"

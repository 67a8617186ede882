"""What the scheduler-level P->D cases share: the daemons' arguments, the prompt, engines
that are checked freed at the end, and helpers that check the pulled bytes. The fixtures
(``daemons``, ``own_daemons``, ``model_dir``, ``engines``) are in conftest.py.

Imported by the test modules only after they have skipped themselves when vLLM is
missing (this module imports vLLM through engine_build and scheduler_support).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from scheduler_support import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SimEngine,
    kill_daemon,
    prompt_tokens,
    run_until,
    start_daemon,
    stop_daemon,
)

from kvd.tools.localcluster import DaemonProcess

# A dead peer's handshake fails after this (the killed-prefill cases stay short).
DAEMON_ARGS = ["--set", "handshake_timeout_s=2"]
PROMPT = 100  # tokens: 3 full blocks of 32 and a partial one
BLOCK = 32  # CPU attention takes block sizes that are multiples of 32


class Daemons(NamedTuple):
    """The conftest's ``daemons`` (one pair per module) and ``own_daemons`` (per test)."""

    prefill: DaemonProcess
    decode: DaemonProcess


MakeEngine = Callable[..., SimEngine]


class OwnDaemons:
    """The conftest's ``own_daemons``: ``own_daemons(extra_args)`` starts a prefill and a
    decode daemon for one test, which may freeze, kill or restart them;
    ``own_daemons.end_also(d)`` hands over another one (a restarted daemon) to end with
    them. ``end()``: in the order started, each live one is resumed and stopped (it must
    exit 0 and leave no shm segment), each dead one has its leftover segments removed."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.made: list[DaemonProcess] = []

    def __call__(self, extra_args: list[str] | None = None) -> Daemons:
        for role in ("p", "d"):
            self.made.append(start_daemon(self.log_dir, role, extra_args))
        return Daemons(*self.made[-2:])

    def end_also(self, daemon: DaemonProcess) -> None:
        self.made.append(daemon)

    def end(self) -> None:
        with contextlib.ExitStack() as ends:  # every daemon ends, even if one stop fails
            for d in reversed(self.made):  # (the stack ends them in the order started)
                ends.callback(stop_daemon if d.proc.poll() is None else kill_daemon, d)
                if d.proc.poll() is None:
                    os.kill(d.proc.pid, signal.SIGCONT)


def closing_engines(build: Callable[..., Any], model_dir: Path) -> Iterator[Callable[..., Any]]:
    """The body of the ``engines`` fixture: ``make(name, daemon, **kwargs)`` builds with
    ``build(name, model_dir, engine_address, **kwargs)``; at the end every engine is
    closed and every live daemon must drop its ranks and free its pools."""
    made: list[tuple[Any, DaemonProcess]] = []

    def make(name: str, daemon: DaemonProcess, **kwargs: Any) -> Any:
        engine = build(name, model_dir, daemon.engine_address, **kwargs)
        made.append((engine, daemon))
        return engine

    yield make
    for engine, _ in made:
        engine.close()
    for engine, daemon in made:
        if daemon.proc.poll() is None:
            with daemon.client(ping_interval_s=0) as c:
                deadline = time.monotonic() + 10
                while left := [e for e in c.status().engines
                               if e.engine_id == engine.engine_id]:
                    assert time.monotonic() < deadline, \
                        f"{engine.engine_id}'s ranks and pools not freed after close: {left}"
                    time.sleep(0.05)


def block_nbytes(e: SimEngine) -> int:
    """Bytes of one block of the whole engine (every layer, every rank, K and V)."""
    return NUM_LAYERS * NUM_KV_HEADS * e.block_size * 2 * HEAD_DIM * 4


def n_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def held(d: DaemonProcess, engine: SimEngine) -> list[Any]:
    """What a prefill daemon holds for one engine (published, not yet released)."""
    with d.client(ping_interval_s=0) as c:
        return [h for h in c.status().held if h.engine_id == engine.engine_id]


def generated(e: SimEngine, request_id: str) -> list[int]:
    return [t for out in e.outputs.get(request_id, []) for t in out.new_token_ids]


def check_pulled(d: SimEngine, request_id: str, p: SimEngine, start: int, end: int) -> None:
    """Tokens [start, end) of the decode request hold the prefill engine's bytes, as they
    were the step kvd reported the pull done, on every rank (each its own heads)."""
    got = d.received[request_id]
    assert not got.failed, f"{request_id}: pull reported failed"
    bad = d.kv_mismatches(got.block_ids, start, end, p.tag, got.caches)
    assert bad == 0, f"{request_id}: {bad} elements of tokens [{start}, {end}) differ from P's"


def pull_to_decode(p: SimEngine, d: SimEngine, params: dict[str, Any], request_id: str,
                   max_tokens: int = 3) -> None:
    """Add the decode request with the prefill's params and step until kvd delivered it."""
    d.add(request_id, PROMPT_TOKENS, max_tokens=max_tokens, kv_transfer_params=params)
    run_until([p, d], lambda: request_id in d.received, what=f"{request_id} received")


PROMPT_TOKENS = prompt_tokens(1, PROMPT)

"""What the scheduler-level P->D cases share: two daemons per module, engines that are
checked freed at the end, and helpers that check the pulled bytes.

Imported by the test modules only after they have skipped themselves when vLLM is
missing (this module imports vLLM through engine_build and scheduler_support).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_build import make_engine
from scheduler_support import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SimEngine,
    daemon_pair,
    prompt_tokens,
    run_until,
    write_model_dir,
)

from kvd.tools.localcluster import DaemonProcess

# A dead peer's handshake fails after this (the killed-prefill cases stay short).
DAEMON_ARGS = ["--set", "handshake_timeout_s=2"]
PROMPT = 100  # tokens: 3 full blocks of 32 and a partial one
BLOCK = 32  # CPU attention takes block sizes that are multiples of 32


@dataclass
class Daemons:
    prefill: DaemonProcess
    decode: DaemonProcess


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """One prefill and one decode daemon for the module (each start costs ~1 s)."""
    logs = tmp_path_factory.mktemp("kvd-logs")
    with daemon_pair(logs, ("p", "d"), DAEMON_ARGS) as (p, d):
        yield Daemons(p, d)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


MakeEngine = Callable[..., SimEngine]


def closing_engines(build: Callable[..., Any], model_dir: Path) -> Iterator[Callable[..., Any]]:
    """The body of an ``engines`` fixture: ``make(name, daemon, **kwargs)`` builds with
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


@pytest.fixture
def engines(model_dir: Path) -> Iterator[MakeEngine]:
    """``engines(name, daemon, **make_engine kwargs)`` (see closing_engines)."""
    yield from closing_engines(make_engine, model_dir)


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

"""engine_child's ``poll``: it returns after its step time even while vLLM's engine core
sends nothing (a decode whose requests wait for a progressive pull's KV).

LLMEngine.step() over vLLM's multiprocess engine core blocks in ``get_output()`` until the
core sends an output; the whole-engine progressive tests polled the decode engine before
starting the prefill, so the decode's pulls waited for a prefill that could not start
until they timed out (test_engine_progressive.py failed with "no seal from the producer").
A stand-in engine with vLLM's SyncMPClient output queue, no vLLM: the default suite runs it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from engine_child import _Child


class _BlockingEngine:
    """LLMEngine.step() over SyncMPClient: takes the core's next output, waiting for it."""

    def __init__(self) -> None:
        self.engine_core = SimpleNamespace(outputs_queue=queue.Queue())
        self.should_execute_dummy_batch = False
        self.steps = 0

    def step(self) -> list[Any]:
        self.steps += 1
        return list(self.engine_core.outputs_queue.get())


@pytest.fixture
def child() -> Iterator[_Child]:
    r, w = os.pipe()
    c = _Child(w)
    c.llm = SimpleNamespace(llm_engine=_BlockingEngine())
    c.inflight = {"d0": []}
    yield c
    c.llm.llm_engine.engine_core.outputs_queue.put([])  # frees a step still waiting
    c.reply.close()
    os.close(r)


def _poll_in_thread(child: _Child, step_s: float) -> tuple[threading.Thread, dict[str, Any]]:
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(child.op_poll({"timeout_s": step_s})),
                         daemon=True)
    t.start()
    return t, got


def test_poll_returns_after_its_step_time_while_the_core_sends_nothing(child: _Child) -> None:
    t0 = time.monotonic()
    t, got = _poll_in_thread(child, 0.2)
    t.join(10)
    assert not t.is_alive(), "poll blocked in engine.step() past its step time"
    assert got == {"results": [], "in_flight": 1}
    assert time.monotonic() - t0 < 5
    assert child.llm.llm_engine.steps == 0  # never entered a step that would block


def test_poll_steps_as_soon_as_the_core_sends_an_output(child: _Child) -> None:
    engine = child.llm.llm_engine
    t, got = _poll_in_thread(child, 1.0)
    time.sleep(0.1)
    out = SimpleNamespace(request_id="other", finished=False,
                          outputs=[SimpleNamespace(token_ids=[])])
    engine.engine_core.outputs_queue.put([out])
    deadline = time.monotonic() + 3
    while engine.steps == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.steps >= 1, "an output came but poll did not step"
    t.join(10)
    assert got["results"] == []

"""A vLLM scheduler that records which prompt tokens each step really computes.

Why: after a KV transfer the decode engine's ``RequestOutput.num_cached_tokens``
is useless as evidence (vLLM copies the prefill side's
``remote_prefill_cached_tokens`` into it), and vLLM's per-step
``enable_logging_iteration_details`` only logs per-step totals across all
requests. A test that asks "did the decode engine load 96 tokens and compute 4"
needs a per-request count of the prompt tokens that went through the model.

``RecordingScheduler`` is vLLM's own ``Scheduler`` with one addition: after
each ``schedule()`` it appends, per scheduled request, the token range the
step computes to a JSON-lines file named by ``$KVD_TEST_SCHED_LOG``. It changes
no decision. On CPU vLLM always uses this synchronous ``Scheduler`` (the CPU
platform forces ``async_scheduling=False``), so subclassing it does not switch
scheduler kinds. ``engine_proc`` selects it with ``scheduler_cls`` and puts this
directory on the engine's ``PYTHONPATH`` (the scheduler runs in the EngineCore
process, so it is imported by name there).

Record fields: ``step`` (scheduler call index), ``req`` (vLLM's internal id:
the caller's id plus ``-`` and 8 random characters), ``start`` (tokens already
computed before the step, including tokens found in the local prefix cache or
loaded by a KV connector), ``n`` (tokens computed this step), ``prompt_len``,
``prompt_part`` (how many of the ``n`` lie inside the prompt), and on a
request's first scheduled step ``local_cached``/``external_cached`` from vLLM's
own ``PrefillStats`` (set when the request was admitted: local prefix-cache hit
and what the KV connector promised to load). A recomputation after a failed
load or a preemption shows up as a later step whose ``start`` went back.

Engine steps (for the daemon-fault tests): ``<sched log>.steps`` gets a line
``{"t", "gap", "steps"}`` whenever the time since the previous ``schedule()`` call (the
previous step's length, or an idle wait) exceeds 50 ms, and twice a second otherwise:
``t`` is CLOCK_MONOTONIC (the test process reads the same clock), ``steps`` the calls
since the last line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

ENV_VAR = "KVD_TEST_SCHED_LOG"


class RecordingScheduler(Scheduler):
    """vLLM's scheduler plus a per-step, per-request record of computed tokens."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(ENV_VAR)
        # Line-buffered append: each record is on disk before the step's outputs
        # can reach the front end, so a finished generate() sees all its records.
        self._probe_file = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._probe_step = 0
        self._probe_seen: set[str] = set()
        self._steps_file = open(path + ".steps", "a", buffering=1) if path else None  # noqa: SIM115
        self._last_t = self._beat_t = time.monotonic()
        self._steps_since = 0

    def _note_step(self) -> None:
        now = time.monotonic()
        gap, self._last_t = now - self._last_t, now
        self._steps_since += 1
        if self._steps_file is not None and (gap > 0.05 or now - self._beat_t >= 0.5):
            self._steps_file.write(json.dumps({"t": now, "gap": gap,
                                               "steps": self._steps_since}) + "\n")
            self._beat_t, self._steps_since = now, 0

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._note_step()
        output = super().schedule(*args, **kwargs)
        if self._probe_file is not None and output.num_scheduled_tokens:
            self._record(output)
        self._probe_step += 1
        return output

    def _record(self, output: SchedulerOutput) -> None:
        assert self._probe_file is not None
        lines = []
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            # schedule() has already advanced num_computed_tokens by n.
            start = request.num_computed_tokens - n
            prompt_len = request.num_prompt_tokens
            rec: dict[str, Any] = {
                "step": self._probe_step,
                "req": req_id,
                "start": start,
                "n": n,
                "prompt_len": prompt_len,
                "prompt_part": max(0, min(start + n, prompt_len) - start),
            }
            if req_id not in self._probe_seen:
                self._probe_seen.add(req_id)
                stats = getattr(request, "prefill_stats", None)
                if stats is not None:
                    rec["local_cached"] = stats.num_local_cached_tokens
                    rec["external_cached"] = stats.num_external_cached_tokens
            lines.append(json.dumps(rec))
        if lines:
            self._probe_file.write("\n".join(lines) + "\n")

    def shutdown(self) -> None:
        super().shutdown()
        # A marker in the engine log: EngineCore teardown (and with it the
        # scheduler-side KV connector's shutdown) really ran.
        print("kvd-test: RecordingScheduler.shutdown done", file=sys.stderr, flush=True)
        if self._probe_file is not None:
            self._probe_file.close()
            self._probe_file = None
        if self._steps_file is not None:
            self._steps_file.close()
            self._steps_file = None

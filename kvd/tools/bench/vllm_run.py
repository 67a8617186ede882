"""``kvd bench vllm``: whole vLLM engines, P/D through kvd and through vLLM's own
NixlConnector, side by side in one run, turns alternating.

The edge of the benchmark: it starts the daemons (``kvd serve``), the vLLM OpenAI
servers (``python -m vllm.entrypoints.openai.api_server``, this interpreter, so run it
from the venv that has vLLM) and one ``kvd router`` per P/D system, sends the
requests, scrapes the decode servers' ``/metrics``, reads the processes' CPU time from
``/proc``, and stops everything it started on every exit path. Its parts: the
systems as data, and the run's settings, ``vllm_systems``; starting and stopping them
``vllm_launch``; processes and HTTP ``vllm_procs``; turns and pauses ``vllm_turns``; the
arithmetic and the table ``vllm_stats``; the trace measures ``vllm_traces``.

Per round, every system in turn (the order rotates each round, so background load
hits all alike), the same prompt for all:

* plain: one streamed request (the reference tokens, its TTFT);
* P/D: the prefill (``max_tokens=1``, ``do_remote_decode``), then the decode request
  with the prefill's ``kv_transfer_params``, streamed: its time to first token is the
  hand-over; then the same prompt through ``kvd router`` (TTFT through the router).

Then batch rounds: N prompts prefilled at once, then N decode requests sent at once;
the decode side's time (sent to last stream end), the spread of first tokens (first to
last) and the decode engine's step (the gaps between tokens of the batch's streams).
Last, an idle window: every process's CPU while nothing is asked.

No vLLM or aiohttp import here: HTTP is the standard library's, engines are processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvd.errors import KvdError
from kvd.ops.trace import read_traces
from kvd.tools.bench.vllm_launch import Launcher, Running, stop_system
from kvd.tools.bench.vllm_procs import (
    Stream,
    host_load,
    metric_sum,
    parallel,
    post_completion,
    scrape,
    session_cpu_s,
    signals_raise,
    stream_completion,
)
from kvd.tools.bench.vllm_stats import (
    TARGET_FIRST_X_WARM,
    Batch,
    Counters,
    Single,
    Summary,
    add_ratios,
    summarize,
    targets,
)
from kvd.tools.bench.vllm_systems import SYSTEMS, BenchConfig
from kvd.tools.bench.vllm_traces import (
    add_trace_measures,
    kvd_parts,
    one_daemon_not_slower_on_kvd_part,
    trace_measures,
)
from kvd.tools.bench.vllm_turns import Group, Hogs, Turns

CLK_TCK = os.sysconf("SC_CLK_TCK")
WARM_UP_SEED = 90_000  # the engines' own warm-up prompt (rounds: < 50_000, batches above)
IDLE_SETTLE_S = 5.0  # in a system's turn, before its idle CPU is measured


# ------------------------------------------------------------------ the run

def _prompt(seed: int, length: int) -> list[int]:
    from kvd.tools.tiny_model.llama import prompt_ids

    return prompt_ids(seed, length)


class VllmBench:
    def __init__(self, cfg: BenchConfig, work: Path, model_dir: Path,
                 log: Any = None) -> None:
        self.cfg = cfg
        self.work = work
        self.model = str(model_dir)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.systems: dict[str, Running] = {}
        self.singles: list[Single] = []
        self.batches: list[Batch] = []
        self.reference: dict[int, str] = {}  # prompt seed -> plain engine's text
        self.failed_batches: dict[str, int] = {}  # system -> batches with no stream at all
        # (system, client time stamps) of each single hand-over, for the breakdown
        self.timelines: list[tuple[str, dict[str, float]]] = []
        # (system, round, sent, first token) of each request through a router
        self.routed: list[tuple[str, int, float, float]] = []
        self.failed_systems: dict[str, str] = {}  # system -> why it was dropped
        self.turns: Turns | None = None  # set by run(): only the measured system runs
        self.hogs: Hogs | None = None
        self.launcher = Launcher(cfg, work, self.model, self.log, self.systems)

    # -------------------------------------------------------------- start / stop

    def start(self) -> None:
        self.launcher.start()

    def sessions(self) -> list[int]:
        """The session ids of every process this run started (stopped or not)."""
        return [p.proc.pid for r in self.systems.values() for p in r.procs] + [
            d.proc.pid for r in self.systems.values() for d in r.daemons]

    def stop(self) -> None:
        if self.turns is not None:  # a stopped process would not act on SIGTERM
            with contextlib.suppress(Exception):
                self.turns.resume_all()
        if self.hogs is not None:
            self.hogs.stop()
        for run in self.systems.values():
            stop_system(run)

    # -------------------------------------------------------------- requests

    def _body(self, seed: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": _prompt(seed, self.cfg.prompt_tokens),
                "max_tokens": self.cfg.max_tokens, "temperature": 0, "ignore_eos": True}

    def _prefill(self, run: Running, seed: int) -> Any:
        """The prefill's kv_transfer_params; None if it failed or took longer than
        2 x decode_timeout_s (a prefill engine whose blocks a stalled transfer holds)."""
        body = {**self._body(seed), "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}}
        try:
            params = post_completion(run.ports["prefill"], body,
                           2 * self.cfg.decode_timeout_s).get("kv_transfer_params")
        except (TimeoutError, OSError, KvdError, ValueError) as exc:
            self.log(f"  {run.spec.name}: prefill request failed ({exc})")
            return None
        if not params:
            self.log(f"  {run.spec.name}: the prefill answered no kv_transfer_params")
        return params or None

    def _decode(self, run: Running, seed: int, params: Any) -> Stream | None:
        """The decode's stream; None if it gave no first token within decode_timeout_s
        (counted as a failed hand-over; vLLM's NixlConnector with its progress thread
        off can wait for the prefill engine's next step) or its prefill failed."""
        if params is None:
            return None
        try:
            return stream_completion(run.ports["decode"],
                                     {**self._body(seed), "kv_transfer_params": params},
                                     self.cfg.decode_timeout_s)
        except (TimeoutError, OSError, KvdError) as exc:
            self.log(f"  {run.spec.name}: decode request failed ({exc})")
            return None

    def _routed(self, run: Running, seed: int) -> Stream | None:
        try:
            return stream_completion(run.router_port, self._body(seed),
                                     self.cfg.decode_timeout_s)
        except (TimeoutError, OSError, KvdError) as exc:
            self.log(f"  {run.spec.name}: request through the router failed ({exc})")
            return None

    def _equal(self, seed: int, text: str) -> int:
        return int(self.reference.get(seed) == text)

    def warm_engines(self) -> None:
        """Every engine, in its system's turn, serves one request of its own: no
        kv_transfer_params, a prompt no round uses. vLLM's first request is slow in its
        own stages (API server to engine core 17-26 ms against 3-6 ms warm); after this,
        round 0 measures what a pair's first transfer costs on engines already serving."""
        seed = self.cfg.seed * 100_000 + WARM_UP_SEED
        for name in self._live(list(self.systems)):
            with self._turn(name):
                for port in self.systems[name].ports.values():
                    stream_completion(port, self._body(seed), self.cfg.decode_timeout_s)

    def single_round(self, rnd: int, order: list[str]) -> None:
        seed = self.cfg.seed * 100_000 + rnd
        for name in self._live(order):
            with self._turn(name):
                self._single(name, rnd, seed)

    def _single(self, name: str, rnd: int, seed: int) -> None:
        run = self.systems[name]
        if not run.spec.disaggregated:
            s = stream_completion(run.ports["plain"], self._body(seed))
            self.reference[seed] = s.text
            self.singles.append(Single(name, rnd, None, s.ttft_s, 1, 1))
            return
        prefill_sent = time.monotonic()
        params = self._prefill(run, seed)
        prefill_answered = time.monotonic()
        handed = self._decode(run, seed, params)
        routed = self._routed(run, seed)
        self.singles.append(Single(
            name, rnd, None if handed is None else handed.ttft_s,
            None if routed is None else routed.ttft_s,
            sum(self._equal(seed, s.text) for s in (handed, routed) if s is not None), 2,
            failed=(handed is None) + (routed is None)))
        if routed is not None:
            self.routed.append((name, rnd, routed.sent_s, routed.token_s[0]))
        if handed is not None:
            self.timelines.append((name, {
                "prefill_sent": prefill_sent, "prefill_answered": prefill_answered,
                "decode_sent": handed.sent_s, "first_token": handed.token_s[0],
                "end": handed.end_s}))

    def batch_round(self, rnd: int, order: list[str]) -> None:
        seeds = [self.cfg.seed * 100_000 + 50_000 + rnd * 1000 + i
                 for i in range(self.cfg.batch)]
        plain = self.systems.get("plain")
        if plain is not None and "plain" in self._live(order):
            with self._turn("plain"):  # references, one at a time (as the single rounds)
                for seed in seeds:
                    self.reference[seed] = stream_completion(plain.ports["plain"],
                                                             self._body(seed)).text
        for name in self._live(order):
            with self._turn(name):
                self._batch(name, rnd, seeds)

    def _batch(self, name: str, rnd: int, seeds: list[int]) -> None:
        run = self.systems[name]
        if run.spec.disaggregated:
            params = parallel([lambda s=s, r=run: self._prefill(r, s) for s in seeds])
            calls = [lambda s=s, p=p, r=run: self._decode(r, s, p)
                     for s, p in zip(seeds, params, strict=True)]
        else:
            port = run.ports["plain"]
            calls = [lambda s=s, p=port: stream_completion(p, self._body(s)) for s in seeds]
        got = parallel(calls)
        streams = [st for st in got if st is not None]
        if not streams:
            self.log(f"  {name}: every request of the batch failed")
            self.failed_batches[name] = self.failed_batches.get(name, 0) + 1
            return
        gaps = [b - a for st in streams
                for a, b in zip(st.token_s, st.token_s[1:], strict=False)]
        self.batches.append(Batch(
            name, rnd, min(st.sent_s for st in streams),
            tuple(st.token_s[0] for st in streams), tuple(st.end_s for st in streams),
            tuple(gaps), sum(self._equal(s, st.text)
                             for s, st in zip(seeds, got, strict=True) if st is not None),
            len(got), failed=len(got) - len(streams),
            tokens_s=tuple(tuple(st.token_s) for st in streams)))

    def idle_cores(self) -> dict[str, float]:
        """Per system, in its turn: CPU cores its engines (and their daemons' share) use
        idle."""
        out = {}
        for name, run in self.systems.items():
            if name in self.failed_systems:
                continue
            sids = ([p.proc.pid for p in run.procs if not p.name.endswith("-router")]
                    + [d.proc.pid for d in run.daemons])
            with self._turn(name):
                # the last requests' bookkeeping, and what a continued process catches
                # up on (timers that came due while it was paused), settle first
                time.sleep(IDLE_SETTLE_S)
                before = sum(session_cpu_s(s) for s in sids)
                t0 = time.monotonic()
                time.sleep(self.cfg.idle_s)
                elapsed = time.monotonic() - t0
                used = sum(session_cpu_s(s) for s in sids) - before
                out[name] = used / elapsed / len(run.spec.engines)
        return out

    def decode_metrics(self) -> dict[str, dict[str, float]]:
        out = {}
        for name, run in self.systems.items():
            if name in self.failed_systems:
                continue
            with self._turn(name):
                out[name] = scrape(run.ports.get("decode") or run.ports["plain"])
        return out

    # -------------------------------------------------------------- turns

    def _groups(self) -> dict[str, Group]:
        return {name: Group(tuple(d.proc.pid for d in run.daemons),
                            tuple(p.proc.pid for p in run.procs))
                for name, run in self.systems.items()}

    @contextlib.contextmanager
    def _turn(self, name: str) -> Iterator[None]:
        """The system's turn: only it runs (the others paused, when pause_others). An
        error of the system's own (a request that raised, a server gone) ends the system,
        not the run: it is reported as failed and the others go on."""
        try:
            if self.turns is None:
                yield
            else:
                with self.turns.turn(name):
                    yield
        except Exception as exc:  # noqa: BLE001 - the system's failure, recorded
            self._fail_system(name, exc)

    def _fail_system(self, name: str, exc: BaseException) -> None:
        why = f"{type(exc).__name__}: {exc}"[:500]
        self.log(f"  {name}: failed ({why}); stopping it, the others go on")
        self.failed_systems[name] = why
        if self.turns is not None:
            self.turns.drop(name)
        stop_system(self.systems[name])

    def _live(self, order: list[str]) -> list[str]:
        return [n for n in order if n not in self.failed_systems]

    def run(self) -> dict[str, Any]:
        names = list(self.systems)
        if self.cfg.hogs:
            self.hogs = Hogs(self.cfg.hogs)
            self.log(f"  {self.cfg.hogs} CPU hog(s) beside the engines")
        if self.cfg.pause_others:
            hogs = self.hogs
            self.turns = Turns(self._groups(), self.cfg.settle_s,
                               hog_pids=(hogs.pids if hogs is not None else tuple))
        if self.cfg.engine_warm_up:
            self.warm_engines()
        before = self.decode_metrics()
        for rnd in range(self.cfg.rounds):
            self.single_round(rnd, self._live(_rotated(names, rnd)))
            self.log(f"  round {rnd + 1}/{self.cfg.rounds} done")
        for rnd in range(self.cfg.batch_rounds):
            self.batch_round(rnd, self._live(_rotated(names, rnd)))
            self.log(f"  batch {rnd + 1}/{self.cfg.batch_rounds} done")
        after = self.decode_metrics()
        idle = self.idle_cores()
        plain_ttft = {s.round: s.ttft_s for s in self.singles if s.system == "plain"}
        summaries = {}
        for name in names:
            if name in self.failed_systems or name not in after or name not in before:
                summaries[name] = Summary(name, notes=[
                    f"failed, not measured after that: {self.failed_systems.get(name)}"])
                continue
            counters = _counters(name, before[name], after[name], self.cfg)
            counters.idle_cores_per_engine = idle.get(name)
            summaries[name] = summarize(
                name, [s for s in self.singles if s.system == name],
                [b for b in self.batches if b.system == name], plain_ttft, counters)
            if self.failed_batches.get(name):
                summaries[name].notes.append(
                    f"{self.failed_batches[name]} batch(es) of {self.cfg.batch} in which "
                    "every request failed (not in the batch figures nor in tokens equal)")
        add_ratios(summaries)
        extra = self.breakdowns(plain_ttft) if self.cfg.breakdown else {}
        add_trace_measures(summaries, extra.pop("co_scheduled", {}), extra.pop("paired", {}))
        goals = targets(summaries)
        if extra.get("first_transfers"):
            goals["first_transfer_le_2x_warm"] = {
                n: f["x_warm"] <= TARGET_FIRST_X_WARM
                for n, f in extra["first_transfers"].items()}
        if "breakdown_samples" in extra:
            parts = kvd_parts(extra["breakdown_samples"], extra["batch_landing"])
            extra["kvd_part"] = {n: asdict(p) for n, p in parts.items()}
            goals["one_daemon_not_slower_than_two_kvd_part"] = \
                one_daemon_not_slower_on_kvd_part(parts)
        if self.turns is not None:
            extra["turn_load"] = self.turns.summary()
        extra["failed_systems"] = dict(self.failed_systems)
        return {**extra, "summaries": [asdict(s) for s in summaries.values()],
                "targets": goals,
                "singles": [asdict(s) for s in self.singles],
                "batches": [asdict(b) for b in self.batches],
                "legend": {n: SYSTEMS[n] for n in names}}


    def breakdowns(self, plain_ttft: dict[int, float]) -> dict[str, Any]:
        """The trace measures of the run (vllm_traces.trace_measures)."""
        trace_dir = self.work / "trace"
        points = read_traces(str(trace_dir)) if trace_dir.is_dir() else []
        return trace_measures(points, self.timelines, self.batches, self.routed,
                              plain_ttft)


def _counters(name: str, before: dict[str, float], after: dict[str, float],
              cfg: BenchConfig) -> Counters:
    def delta(metric: str, **labels: str) -> float:
        return metric_sum(after, metric, **labels) - metric_sum(before, metric, **labels)

    requests = cfg.rounds * (1 if name == "plain" else 2) + cfg.batch_rounds * cfg.batch
    c = Counters(decode_requests=requests)
    c.decode_computed_tokens = delta("vllm:prompt_tokens_by_source_total",
                                     source="local_compute")
    c.decode_loaded_tokens = delta("vllm:prompt_tokens_by_source_total",
                                   source="external_kv_transfer")
    if name.startswith("kvd"):
        c.bytes_moved = delta("vllm:kvd_pulled_bytes_total")
    elif name.startswith("nixl"):
        nixl = delta("vllm:nixl_bytes_transferred_sum")
        c.bytes_moved = nixl if nixl else None
    return c


def _rotated(names: list[str], rnd: int) -> list[str]:
    """The plain engine first (its tokens are the reference), the rest rotated."""
    rest = [n for n in names if n != "plain"]
    k = rnd % len(rest) if rest else 0
    return [n for n in names if n == "plain"] + rest[k:] + rest[:k]


def run_bench(cfg: BenchConfig, work_dir: str | None = None,
              log: Any = None) -> dict[str, Any]:
    """Start everything, measure, stop everything; the JSON result."""
    if importlib.util.find_spec("vllm") is None:
        raise KvdError("kvd bench vllm needs vLLM in this interpreter (run it from the "
                       "venv that has it, e.g. .venv-vllm/bin/kvd bench vllm)")
    keep = work_dir is not None
    work = Path(work_dir or tempfile.mkdtemp(prefix="kvd-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    from kvd.tools.tiny_model.llama import build_tiny_llama

    # A model with as many positions as the longest request (--prompt-tokens 8192):
    # past them vLLM's rotary cache was read out of range (a plain engine streamed no
    # token for an 8K prompt under VLLM_ALLOW_LONG_MAX_MODEL_LEN).
    model = build_tiny_llama(work / "model", max_positions=max(4096, cfg.max_model_len),
                             shape=cfg.model_shape)
    bench = VllmBench(cfg, work, model, log)
    load_before = host_load()
    failed = True
    try:
        with signals_raise():
            bench.log(f"starting {len(cfg.systems)} systems (logs in {work})")
            bench.start()
            result = bench.run()
            failed = False
    finally:
        bench.stop()
        if not keep and not failed:
            shutil.rmtree(work, ignore_errors=True)
    result["host"] = {"cpus": os.cpu_count(), "load_before": load_before,
                      "load_after": host_load(), "hogs": cfg.hogs,
                      "pause_others": cfg.pause_others}
    result["started_sessions"] = bench.sessions()
    result["config"] = asdict(cfg)
    return result

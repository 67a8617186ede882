"""A chaos soak through whole vLLM engines: a prefill and a decode engine, each on its
own ``kvd serve``, under continuous P/D load for minutes while a seeded schedule
freezes and kills the daemons and kills the prefill engine.

Heavy and long (``-m soak``; neither the default suite nor README's vLLM command runs
it). Knobs (environment): ``KVD_SOAK_SECONDS`` (300: how long load runs and faults are
injected; the drain and the final checks come after), ``KVD_SOAK_SEED`` (the fault
schedule; printed, so a run's schedule can be replayed), ``KVD_SOAK_REPORT`` (where the
JSON report goes; default ``soak-report.json`` in the test's tmp dir),
``KVD_SOAK_PROGRESSIVE`` (0.5: the share of P/D requests sent progressively, below),
``KVD_SOAK_TRACES=1`` (tracing on everywhere: each P/D request gets a trace context in
its kv_transfer_params, both daemons and both engines export their spans to an OTLP
receiver the test runs, and the report's ``traces`` counts the requests whose trace is
complete and linked, and, for a recomputed one, whether its trace says where it failed).

Load: the decode engine keeps ``PD_IN_FLIGHT`` P/D requests and one plain request (no
kv_transfer_params) in flight at all times (``EngineProc.submit``/``poll``); a prefill
thread prefills the P/D prompts one at a time (max_tokens=1, do_remote_decode), as a
router does, and hands their kv_transfer_params over. Prompts come from a fixed pool
whose tokens the decode engine computed alone (plain requests, before any fault):
the oracle. Prefix caching is off on both engines, so every P/D request moves its KV
through kvd (or recomputes it). A seeded share of the P/D requests is progressive, as
``kvd router --progressive`` sends them: the decode engine admits the request first (its
daemon's pull waits at the prefill's daemon), and only then does the prefill thread send
it to the prefill engine, whose chunked prefill (``PREFILL_CHUNK`` tokens a step) seals
each chunk's blocks as it goes, read by the decode's daemon while the next is computed.
The prefill's outcome of a progressive request is only recorded (``prefill_error``): the
decode's result is what is judged, like any other.

Faults, one at a time, each 10-30 s after the previous one ended, the kind drawn from
a seeded shuffled deck (every kind once per round of six): freeze (SIGSTOP the process
group) the prefill or the decode daemon for 1-15 s; kill -9 the prefill or the decode
daemon and start it again at once on the same addresses (it adopts the engines' shm
pools; the engines register again by themselves); kill -9 the prefill engine (its
process group: child, EngineCore, worker) and start a new one with the same
configuration and engine id; pause the whole host: freeze both daemons and both
engines together for longer than ``engine_timeout_s`` (31-36 s; a VM pause, a cgroup
throttle), after which no engine may have lost P/D.

Judged: every P/D and plain request returns the oracle's tokens, loaded or recomputed,
or (only a prefill that was in the prefill engine when it was killed) a clean error; no
request finishes more than ``STALL_LIMIT_S`` after the later of its start and the end
of the last fault before its finish; the decode engine's plain tokens never stop for
more than ``PLAIN_GAP_LIMIT_S`` during a fault (but a host pause, which freezes it); a
P/D request started after a host pause, away from other faults, loads its KV (a pause
that retired an engine for good would make every later one recompute); at the end
(engines still up) neither daemon holds, pulls or pins anything and no registration
of a dead engine is left; the daemons then exit 0 on SIGTERM and /dev/shm holds
nothing of kvd's. vLLM's own shared-memory queues (``psm_*``) that the killed engines
left are counted and removed.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_proc import EngineProc, EngineProcError
from engine_support import BLOCK, StartEngine, kv_config, random_prompts
from shm_reaper import SHM_DIR, reap_vllm_segments

from kvd.integrations.connector_core.params import ProgressivePrefill
from kvd.ops.tracecontext import new_traceparent
from kvd.tools.localcluster import DaemonProcess

SOAK_S = float(os.environ.get("KVD_SOAK_SECONDS", "300"))
TRACES = os.environ.get("KVD_SOAK_TRACES", "") not in ("", "0")
SEED = int(os.environ.get("KVD_SOAK_SEED", "0") or 0)
PROGRESSIVE = float(os.environ.get("KVD_SOAK_PROGRESSIVE", "0.5") or 0)

# Startup (three engines, one of them restarted at most every fault), the soak, the
# last fault's restart, the drain and the settling: well within SOAK_S + 20 min.
pytestmark = [pytest.mark.vllm]

PD_IN_FLIGHT = 3  # P/D requests in the decode engine at once, besides the plain one
PD_MAX_TOKENS = 8
PLAIN_MAX_TOKENS = 16
PREFILL_CHUNK = 32  # the prefill engine's max_num_batched_tokens: a prompt in 4-6 steps
GAP_S = (10.0, 30.0)  # between the end of one fault and the start of the next
FREEZE_S = (1.0, 15.0)
ENGINE_TIMEOUT_S = 30.0  # the daemons' default engine_timeout_s
PAUSE_S = (ENGINE_TIMEOUT_S + 1.0, ENGINE_TIMEOUT_S + 6.0)  # a whole-host pause
STALL_LIMIT_S = 60.0
PLAIN_GAP_LIMIT_S = 5.0
DRAIN_S = 120.0  # after the soak: in-flight requests must be done by then
SETTLE_S = 60.0  # after the drain: the daemons must hold nothing by then
# handshake_timeout_s short so that a dead producer is noticed soon; shm pools so that a
# restarted daemon adopts them.
DAEMON_ARGS = ["--set", "handshake_timeout_s=2", "--set", "pool_backing=shm"]

KINDS = ("freeze_prefill_daemon", "freeze_decode_daemon", "kill_prefill_daemon",
         "kill_decode_daemon", "kill_prefill_engine", "pause_host")


@dataclass
class Fault:
    kind: str
    gap_s: float  # quiet time before it
    freeze_s: float = 0.0
    start: float = 0.0  # monotonic
    end: float = 0.0


@dataclass
class Request:
    rid: str
    kind: str  # "pd" | "plain"
    prompt: int  # index in its pool
    start: float
    prefilled: float = 0.0
    done: float = 0.0
    outcome: str = ""  # loaded | recomputed | partly_recomputed | no_kv | error | plain
    error: str = ""
    tokens_ok: bool = False
    token_times: list[float] = field(default_factory=list)
    traceparent: str = ""  # KVD_SOAK_TRACES: the context its prefill was sent with
    progressive: bool = False  # sent to the decode first, then to the prefill
    prefill_error: str = ""  # a progressive request's prefill failed (the decode judges it)


def schedule(seed: int, n: int) -> list[Fault]:
    """``n`` faults from ``seed``: kinds from a deck shuffled again each round."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    deck: list[str] = []
    while len(faults) < n:
        if not deck:
            deck = list(KINDS)
            rng.shuffle(deck)
        kind = deck.pop()
        freeze = (round(rng.uniform(*FREEZE_S), 2) if kind.startswith("freeze")
                  else round(rng.uniform(*PAUSE_S), 2) if kind == "pause_host" else 0.0)
        faults.append(Fault(kind, round(rng.uniform(*GAP_S), 2), freeze))
    return faults


class Soak:
    """The running soak: daemons, engines, the load threads and the records."""

    def __init__(self, start_engine: StartEngine, logs: Path) -> None:
        self.start_engine = start_engine
        self.logs = logs
        self.tag = uuid.uuid4().hex[:6]
        self.daemons: dict[str, DaemonProcess] = {}
        self.incarnations: dict[str, int] = {"prefill": 0, "decode": 0}
        self.prefill_id = f"soak-p-{self.tag}"
        self.decode_id = f"soak-d-{self.tag}"
        self.prefill: EngineProc | None = None
        self.prefill_up = threading.Condition()
        self.prefill_engines = 0
        self.decode: EngineProc | None = None
        self.stop = threading.Event()  # no new requests; in-flight ones drain
        self.prefill_done = threading.Event()
        self.decode_done = threading.Event()
        self.failures: list[str] = []
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.handoff: queue.Queue[tuple[Request, dict | None]] = queue.Queue(maxsize=2)
        self.admitted: dict[str, threading.Event] = {}  # progressive: the decode submitted it
        self.pd_prompts = random_prompts(16, 100, seed=SEED * 1000 + 1, step=5)
        self.plain_prompts = random_prompts(4, 40, seed=SEED * 1000 + 2, step=6)
        self.want_pd: list[list[int]] = []
        self.want_plain: list[list[int]] = []
        self.faults: list[Fault] = []
        self.current: Fault | None = None
        self.shm_before: set[str] = set()
        self.kvd_pulls_failed = 0  # scraped from each decode daemon before it goes
        self.receiver: Any = None  # KVD_SOAK_TRACES: the OTLP receiver (support.otlp_receiver)
        if TRACES:
            from support.otlp_receiver import OtlpReceiver

            self.receiver = OtlpReceiver()
            os.environ.update({  # inherited by both daemons and every engine
                "KVD_OTEL_TRACES": "true", "OTEL_BSP_SCHEDULE_DELAY": "200",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.receiver.url})
        self.scrape_errors: list[str] = []

    # ------------------------------------------------------------ processes

    def start_daemon(self, role: str) -> DaemonProcess:
        old = self.daemons.get(role)
        n = self.incarnations[role]
        self.incarnations[role] = n + 1
        name = f"soak{role[0]}{self.tag}"
        d = DaemonProcess.start(name, self.logs / f"{role}-daemon-{n}", DAEMON_ARGS,
                                engine_address=old.engine_address if old else "",
                                peer_address=old.peer_address if old else "")
        self.daemons[role] = d
        return d

    def start_prefill(self) -> EngineProc:
        self.prefill_engines += 1
        return self.start_engine(
            f"soak-prefill-{self.prefill_engines}",
            kv_transfer_config=kv_config(self.prefill_id, self.daemons["prefill"],
                                         kv_load_failure_policy="recompute"),
            block_size=BLOCK, enable_prefix_caching=False,
            llm_kwargs={"enable_chunked_prefill": True, "max_num_batched_tokens": PREFILL_CHUNK})

    def start_all(self) -> None:
        self.shm_before = {p.name for p in SHM_DIR.iterdir()}
        self.start_daemon("prefill")
        self.start_daemon("decode")
        self.prefill = self.start_prefill()
        self.decode = self.start_engine(
            "soak-decode",
            kv_transfer_config=kv_config(self.decode_id, self.daemons["decode"],
                                         kv_load_failure_policy="recompute"),
            block_size=BLOCK, enable_prefix_caching=False)
        # The oracle: the decode engine alone, before any fault.
        pd = self.decode.generate(self.pd_prompts, max_tokens=PD_MAX_TOKENS)
        plain = self.decode.generate(self.plain_prompts, max_tokens=PLAIN_MAX_TOKENS)
        self.want_pd = [r["token_ids"] for r in pd]
        self.want_plain = [r["token_ids"] for r in plain]

    # ----------------------------------------------------------------- load

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)
        self.stop.set()

    def hand_over(self, req: Request, params: dict[str, Any] | None) -> None:
        """To the decode loop, which takes it even while draining."""
        while not self.decode_done.is_set():
            try:
                self.handoff.put((req, params), timeout=0.5)
                return
            except queue.Full:
                continue

    def progressive_first(self, req: Request) -> dict[str, Any]:
        """Hand ``req`` to the decode as progressive and wait until the decode engine has
        it (its pull is then on its way to the prefill's daemon); the prefill's params."""
        tid = f"t-{self.tag}-{req.rid}"
        params = ProgressivePrefill(self.prefill_id, tid,
                                    self.daemons["prefill"].peer_address).to_params()
        if req.traceparent:
            params["traceparent"] = req.traceparent
        admitted = self.admitted[req.rid] = threading.Event()
        self.hand_over(req, params)
        while not admitted.wait(0.5) and not self.decode_done.is_set():
            pass
        return {"do_remote_decode": True, "kvd_progressive": True, "kvd_transfer_id": tid}

    def prefill_loop(self) -> None:
        rng = random.Random(SEED * 1000 + 3)
        which = random.Random(SEED * 1000 + 5)  # progressive or not; prompts stay seeded
        n = 0
        try:
            while not self.stop.is_set():
                with self.prefill_up:
                    while self.prefill is None and not self.stop.is_set():
                        self.prefill_up.wait(0.5)
                    engine = self.prefill
                if engine is None:
                    break
                idx = rng.randrange(len(self.pd_prompts))
                req = Request(f"pd{n}", "pd", idx, time.monotonic(),
                              progressive=which.random() < PROGRESSIVE)
                params_in: dict[str, Any] = {"do_remote_decode": True}
                if TRACES:  # as a router does: one trace per request
                    req.traceparent = new_traceparent(1.0)
                n += 1
                with self.lock:
                    self.requests.append(req)
                if req.progressive:
                    params_in = self.progressive_first(req)
                if TRACES:
                    params_in["traceparent"] = req.traceparent
                try:
                    [out] = engine.generate([self.pd_prompts[idx]], max_tokens=1,
                                            kv_transfer_params=[params_in],
                                            request_ids=[req.rid], timeout_s=120)
                except EngineProcError as exc:
                    if req.progressive:  # the decode has it: it loads, or recomputes
                        req.prefill_error = str(exc).splitlines()[0]
                    else:
                        req.done = time.monotonic()
                        req.outcome = "error"
                        req.error = str(exc).splitlines()[0]
                    with self.prefill_up:
                        if self.prefill is engine:  # not yet taken down by a fault
                            self.prefill = None
                    engine.close(timeout_s=5)
                    continue
                req.prefilled = time.monotonic()
                if req.progressive:
                    continue
                params = out["kv_transfer_params"]
                if not (params and params.get("do_remote_prefill")):
                    params = None  # nothing published: the decode computes it all
                self.hand_over(req, params)
        except Exception as exc:  # noqa: BLE001 - recorded, judged by the test
            self.fail(f"prefill thread: {exc!r}")
        finally:
            self.prefill_done.set()

    def decode_loop(self) -> None:
        assert self.decode is not None
        inflight: dict[str, Request] = {}
        plain_n = 0
        rng = random.Random(SEED * 1000 + 4)
        stopped_at = 0.0
        try:
            while True:
                stopping = self.stop.is_set()
                if stopping and not stopped_at:
                    stopped_at = time.monotonic()
                if stopping and not inflight and self.prefill_done.is_set() \
                        and self.handoff.empty():
                    return
                subs = []
                if not stopping and not any(r.kind == "plain" for r in inflight.values()):
                    idx = rng.randrange(len(self.plain_prompts))
                    req = Request(f"plain{plain_n}", "plain", idx, time.monotonic())
                    plain_n += 1
                    subs.append((req, {"request_id": req.rid,
                                       "prompt": self.plain_prompts[idx],
                                       "max_tokens": PLAIN_MAX_TOKENS,
                                       "kv_transfer_params": None}))
                while sum(r.kind == "pd" for r in inflight.values()) \
                        + sum(1 for _ in subs if _[0].kind == "pd") < PD_IN_FLIGHT:
                    try:
                        req, params = self.handoff.get_nowait()
                    except queue.Empty:
                        break
                    subs.append((req, {"request_id": req.rid,
                                       "prompt": self.pd_prompts[req.prompt],
                                       "max_tokens": PD_MAX_TOKENS,
                                       "kv_transfer_params": params}))
                    if params is None:
                        req.outcome = "no_kv"
                if subs:
                    self.decode.submit([s[1] for s in subs])
                    for req, _ in subs:
                        inflight[req.rid] = req
                        if req.rid in self.admitted:
                            self.admitted[req.rid].set()
                        if req.kind == "plain":
                            with self.lock:
                                self.requests.append(req)
                for out in self.decode.poll(step_s=0.2, timeout_s=120):
                    self.judge(inflight.pop(out["request_id"]), out)
                if stopping and time.monotonic() - stopped_at > DRAIN_S:
                    self.fail(f"requests still in flight {DRAIN_S:.0f} s into the drain: "
                              f"{sorted(inflight)}")
                    return
        except Exception as exc:  # noqa: BLE001 - recorded, judged by the test
            self.fail(f"decode thread: {exc!r}")
        finally:
            self.decode_done.set()

    def judge(self, req: Request, out: dict[str, Any]) -> None:
        req.done = time.monotonic()
        req.token_times = out["token_times"]
        want = (self.want_pd[req.prompt] if req.kind == "pd"
                else self.want_plain[req.prompt])
        req.tokens_ok = out["token_ids"] == want
        if req.kind == "plain":
            req.outcome = "plain"
        elif req.outcome != "no_kv":
            computed = out["prompt_tokens_computed"]
            full = (out["prompt_len"] - 1) // BLOCK * BLOCK  # what a P/D request loads
            loaded = out["prompt_len"] - computed if computed is not None else -1
            req.outcome = ("unknown" if computed is None else "loaded" if loaded >= full
                           else "recomputed" if loaded <= 0 else "partly_recomputed")

    # --------------------------------------------------------------- faults

    def inject(self, fault: Fault) -> None:
        fault.start = time.monotonic()
        self.current = fault
        role = "prefill" if "prefill" in fault.kind else "decode"
        if fault.kind == "pause_host":
            groups = [d.proc.pid for d in self.daemons.values()]
            with self.prefill_up:
                groups += [e.proc.pid for e in (self.prefill, self.decode) if e is not None]
                for pid in groups:
                    os.killpg(pid, signal.SIGSTOP)
                try:
                    self.stop.wait(fault.freeze_s)
                finally:
                    for pid in groups:
                        try:
                            os.killpg(pid, signal.SIGCONT)
                        except ProcessLookupError:
                            pass
        elif fault.kind.startswith("freeze"):
            d = self.daemons[role]
            os.killpg(d.proc.pid, signal.SIGSTOP)
            try:
                self.stop.wait(fault.freeze_s)
            finally:
                os.killpg(d.proc.pid, signal.SIGCONT)
        elif fault.kind.endswith("daemon"):
            d = self.daemons[role]
            if role == "decode":
                self.scrape_failed_pulls(d)
            os.killpg(d.proc.pid, signal.SIGKILL)
            d.proc.wait(10)
            self.start_daemon(role)
        else:
            with self.prefill_up:
                old, self.prefill = self.prefill, None
            if old is not None:
                try:
                    os.killpg(old.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            new = self.start_prefill()
            with self.prefill_up:
                self.prefill = new
                self.prefill_up.notify_all()
        fault.end = time.monotonic()
        self.current = None

    def scrape_failed_pulls(self, d: DaemonProcess) -> None:
        """Add the pulls ``d`` reported failed (kvd_transfers_total, consumer side)."""
        name = "kvd_transfers_total"
        try:
            self.kvd_pulls_failed += int(d.metric(name, role="consumer")
                                         - d.metric(name, role="consumer", outcome="ok"))
        except OSError as exc:  # a count, not a judgement: say so in the report
            self.scrape_errors.append(repr(exc))

    def run_faults(self, t0: float) -> None:
        for fault in schedule(SEED, 1000):
            if self.stop.wait(fault.gap_s) or time.monotonic() - t0 >= SOAK_S:
                return
            self.faults.append(fault)
            self.inject(fault)
            print(f"  {time.monotonic() - t0:6.1f} s  {fault.kind}"
                  f"{f' {fault.freeze_s:.1f} s' if fault.freeze_s else ''}: "
                  f"{fault.end - fault.start:.1f} s", flush=True)
            if self.stop.is_set():
                return

    # ------------------------------------------------------------ the end

    def settle(self) -> float:
        """Seconds until neither daemon holds, pulls or pins anything and no rank of a
        dead engine is registered; fails the soak after SETTLE_S."""
        t0 = time.monotonic()
        while True:
            left = []
            for role, d in self.daemons.items():
                with d.client(ping_interval_s=0) as c:
                    st = c.status()
                if st.held:
                    left.append(f"{role} daemon holds {len(st.held)}")
                if st.pulls:
                    left.append(f"{role} daemon has {len(st.pulls)} pulls")
                for r in st.engines:
                    if r.gone or r.pins:
                        left.append(f"{role} daemon: {r.engine_id}/{r.rank} gone={r.gone} "
                                    f"pins={r.pins}")
            if not left:
                return time.monotonic() - t0
            waited = time.monotonic() - t0
            if int(waited) % 10 == 0 and waited - int(waited) < 0.5:
                print(f"  settling, {waited:.0f} s: {left}", flush=True)
            if time.monotonic() - t0 > SETTLE_S:
                self.fail(f"after {SETTLE_S:.0f} s: {left}")
                return time.monotonic() - t0
            time.sleep(0.5)

    def report(self, elapsed_s: float, settle_s: float, leftover: dict) -> dict:
        pd = [r for r in self.requests if r.kind == "pd"]
        plain = [r for r in self.requests if r.kind == "plain"]
        outcomes: dict[str, int] = {}
        for r in pd:
            outcomes[r.outcome or "unfinished"] = outcomes.get(r.outcome or "unfinished", 0) + 1
        progressive: dict[str, int] = {}
        for r in pd:
            if r.progressive:
                key = r.outcome or "unfinished"
                progressive[key] = progressive.get(key, 0) + 1
        by_kind = {k: sum(f.kind == k for f in self.faults) for k in KINDS}
        stalls = [stall(r, self.faults) for r in self.requests if r.done and r.outcome != "error"]
        gaps = [plain_gap(plain, f) for f in self.faults if f.kind != "pause_host"]
        return {
            "seed": SEED, "soak_s": SOAK_S, "elapsed_s": round(elapsed_s, 1),
            "requests": len([r for r in self.requests if r.done]),
            "pd_requests": len(pd), "plain_requests": len(plain),
            "pd_outcomes": outcomes,
            "progressive_share": PROGRESSIVE, "progressive_outcomes": progressive,
            "progressive_prefill_errors": sum(1 for r in pd if r.prefill_error),
            "recomputed": outcomes.get("recomputed", 0) + outcomes.get("partly_recomputed", 0),
            "recomputed_by_fault": recomputed_by_fault(pd, self.faults),
            "errors": outcomes.get("error", 0),
            "wrong_tokens": sum(1 for r in self.requests if r.done and r.outcome != "error"
                                and not r.tokens_ok),
            "faults": len(self.faults), "faults_by_kind": by_kind,
            "fault_durations_s": [f"{f.kind} {f.end - f.start:.1f}" for f in self.faults],
            # kvd's side of "recomputed": the pulls the decode daemons reported failed
            "kvd_pulls_failed": self.kvd_pulls_failed, "scrape_errors": self.scrape_errors,
            "longest_stall_s": round(max(stalls, default=0.0), 2),
            "longest_plain_token_gap_in_a_fault_s": round(max(gaps, default=0.0), 2),
            "after_pause": after_pause(pd, self.faults),
            "settle_s": round(settle_s, 2),
            **({"traces": trace_counts(pd, self.receiver.snapshot())}
               if self.receiver is not None else {}),
            **leftover,
            "failures": self.failures,
        }


def trace_counts(pd: list[Request], spans: list[Any]) -> dict[str, Any]:
    """Per P/D request handed over with its KV published: is its trace complete and linked
    (the prefill daemon's hold, the decode daemon's pull and the decode connector's wait
    for the KV, each a child of the request's context), and, for one recomputed, does an
    error span say where it failed."""
    by_trace: dict[str, list[Any]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    out: dict[str, Any] = {"loaded": 0, "loaded_complete": 0, "recomputed": 0,
                           "recomputed_says_where": 0, "incomplete": []}
    for r in pd:
        if not r.traceparent or r.progressive or r.outcome not in (
                "loaded", "recomputed", "partly_recomputed"):
            continue
        trace = by_trace.get(r.traceparent[3:35], [])
        parent = r.traceparent[36:52]
        linked = {s.name for s in trace if s.parent_id == parent}
        if r.outcome == "loaded":
            out["loaded"] += 1
            if {"kvd.hold", "kvd.pull", "kvd.wait_kv"} <= linked:
                out["loaded_complete"] += 1
            else:
                out["incomplete"].append(f"{r.rid}: {sorted(linked)}")
        else:
            out["recomputed"] += 1
            errors = sorted(f"{s.name}: {s.error[:80]}" for s in trace if s.is_error)
            if errors:
                out["recomputed_says_where"] += 1
            else:
                out["incomplete"].append(f"{r.rid} (recomputed): {sorted(linked)}")
    done = out["loaded"] + out["recomputed"]
    out["complete_ratio"] = round((out["loaded_complete"] + out["recomputed_says_where"])
                                  / done, 4) if done else None
    return out


def stall(req: Request, faults: list[Fault]) -> float:
    """How long ``req`` took after the later of its start and the end of the last fault
    that ended before it finished."""
    ends = [f.end for f in faults if f.end and f.end <= req.done]
    return req.done - max([req.start, *ends])


def recomputed_by_fault(pd: list[Request], faults: list[Fault]) -> dict[str, int]:
    """Recomputed P/D requests by the kind of the fault whose window (or the 5 s after
    it) overlapped their lives; "none" when no fault did."""
    got: dict[str, int] = {}
    for r in pd:
        if r.outcome not in ("recomputed", "partly_recomputed"):
            continue
        kinds = sorted({f.kind for f in faults if f.start <= r.done and r.start <= f.end + 5})
        key = "+".join(kinds) or "none"
        got[key] = got.get(key, 0) + 1
    return got


def after_pause(pd: list[Request], faults: list[Fault]) -> dict[str, int]:
    """Outcomes of the P/D requests that started after a host pause ended and overlapped
    no fault (nor the 5 s after one): P/D must have come back, loaded, not recomputed."""
    got: dict[str, int] = {}
    for f in faults:
        if f.kind != "pause_host" or not f.end:
            continue
        for r in pd:
            if r.start < f.end or not r.done or any(
                    g.start <= r.done and r.start <= g.end + 5 for g in faults):
                continue
            got[r.outcome] = got.get(r.outcome, 0) + 1
    return got


def plain_gap(plain: list[Request], fault: Fault) -> float:
    """The longest time without a plain token from the decode engine during ``fault``."""
    times = sorted(t for r in plain for t in r.token_times if fault.start <= t <= fault.end)
    edges = [fault.start, *times, fault.end]
    return max(b - a for a, b in zip(edges, edges[1:], strict=False))


def kvd_segments(tag: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"kvd-soak?{tag}*"))


def run_soak(soak: Soak, leftover: dict[str, Any]) -> tuple[float, float]:
    """Start everything, run load and faults for SOAK_S, drain, settle, stop; the
    soak's (elapsed, settle) seconds. Every process is ended on every path."""
    threads: list[threading.Thread] = []
    settle_s = elapsed = 0.0
    try:
        soak.start_all()
        threads = [threading.Thread(target=soak.prefill_loop, name="soak-prefill", daemon=True),
                   threading.Thread(target=soak.decode_loop, name="soak-decode", daemon=True)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        soak.run_faults(t0)
        while not soak.stop.is_set() and time.monotonic() - t0 < SOAK_S:
            soak.stop.wait(1.0)
        soak.stop.set()
        for t in threads:
            t.join(DRAIN_S + 60)
            if t.is_alive():
                soak.fail(f"{t.name} did not finish")
        elapsed = time.monotonic() - t0
        if not soak.failures:
            settle_s = soak.settle()
        soak.scrape_failed_pulls(soak.daemons["decode"])
        for e in (soak.decode, soak.prefill):
            if e is not None:
                e.close()
        for role, d in soak.daemons.items():
            rc = d.stop()
            if rc != 0:
                soak.fail(f"{role} daemon exited {rc} on SIGTERM")
        leftover["kvd_shm_left"] = kvd_segments(soak.tag)
    finally:
        soak.stop.set()
        for d in soak.daemons.values():
            if d.proc.poll() is None:
                try:
                    os.killpg(d.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                d.kill()
        for t in threads:
            t.join(30)
        for e in (soak.decode, soak.prefill):
            if e is not None:
                e.close(timeout_s=10)
        for name in kvd_segments(soak.tag):  # a failed run's leftovers (judged above)
            (SHM_DIR / name).unlink(missing_ok=True)
        # What the killed engines left: vLLM's message queues and multiprocessing's
        # named semaphores (nobody unlinks them after a SIGKILL of the whole group).
        leftover["vllm_shm_reaped"] = len(
            reap_vllm_segments(soak.shm_before)
            + reap_vllm_segments(soak.shm_before, pattern="sem.mp-*"))
        leftover["shm_new_after"] = sorted({p.name for p in SHM_DIR.iterdir()}
                                           - soak.shm_before)
    return elapsed, settle_s


def test_the_schedule_is_seeded_and_deals_every_kind_each_round() -> None:
    assert schedule(7, 12) == schedule(7, 12) != schedule(8, 12)
    faults = schedule(7, 12)
    for first in (faults[:6], faults[6:]):
        assert sorted(f.kind for f in first) == sorted(KINDS)
    for f in faults:
        assert GAP_S[0] <= f.gap_s <= GAP_S[1]
        assert (FREEZE_S[0] <= f.freeze_s <= FREEZE_S[1]) == f.kind.startswith("freeze")
        assert (PAUSE_S[0] <= f.freeze_s <= PAUSE_S[1]) == (f.kind == "pause_host")
        assert f.kind != "pause_host" or f.freeze_s > ENGINE_TIMEOUT_S


def test_a_stall_counts_from_the_last_fault_end_and_a_plain_gap_from_the_edges() -> None:
    faults = [Fault("freeze_prefill_daemon", 10, 5, start=100.0, end=105.0),
              Fault("kill_decode_daemon", 10, start=120.0, end=121.0)]
    assert stall(Request("a", "pd", 0, start=90.0, done=108.0), faults) == 3.0
    assert stall(Request("b", "pd", 0, start=106.0, done=108.0), faults) == 2.0
    # finished during a fault: from its start (that fault has not ended)
    assert stall(Request("c", "pd", 0, start=119.0, done=120.5), faults) == 1.5
    plain = [Request("p", "plain", 0, start=99.0, done=104.0,
                     token_times=[99.5, 100.5, 101.0, 103.5])]
    assert plain_gap(plain, faults[0]) == 2.5  # 101.0 -> 103.5
    assert plain_gap(plain, faults[1]) == 1.0  # no token in it at all


def test_trace_counts_need_every_span_linked_and_an_error_for_a_recompute() -> None:
    from support.otlp_receiver import SpanRecord

    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"

    def span(name: str, parent: str = "b" * 16, error: str = "") -> SpanRecord:
        return SpanRecord("kvd", name, "a" * 32, "c" * 16, parent, 0, 1, {}, error,
                          bool(error))

    loaded = Request("pd0", "pd", 0, 0.0, outcome="loaded", traceparent=tp)
    redone = Request("pd1", "pd", 0, 0.0, outcome="recomputed", traceparent=tp)
    full = [span("kvd.hold"), span("kvd.pull"), span("kvd.wait_kv")]
    assert trace_counts([loaded], full)["complete_ratio"] == 1.0
    assert trace_counts([loaded], full[:2])["complete_ratio"] == 0.0
    assert trace_counts([loaded], [*full[:2], span("kvd.wait_kv", "d" * 16)])[
        "complete_ratio"] == 0.0  # not linked to the request's context
    assert trace_counts([redone], full)["complete_ratio"] == 0.0
    assert trace_counts([redone], [span("kvd.pull", error="peer_lost: gone")])[
        "complete_ratio"] == 1.0


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 1200)
def test_chaos_soak(start_engine: StartEngine, tmp_path: Path) -> None:
    soak = Soak(start_engine, tmp_path)
    print(f"\nchaos soak: seed {SEED}, {SOAK_S:.0f} s, logs {tmp_path}", flush=True)
    leftover: dict[str, Any] = {}
    elapsed = settle_s = 0.0
    try:
        elapsed, settle_s = run_soak(soak, leftover)
    except BaseException as exc:
        soak.failures.append(f"soak aborted: {exc!r}")
        raise
    finally:
        report = soak.report(elapsed, settle_s, leftover)
        path = Path(os.environ.get("KVD_SOAK_REPORT") or tmp_path / "soak-report.json")
        path.write_text(json.dumps({**report, "requests_detail": [
            asdict(r) | {"token_times": len(r.token_times)} for r in soak.requests]},
            indent=1))
        print(json.dumps(report, indent=1))
        print(f"report: {path}")
        if soak.receiver is not None:
            soak.receiver.close()
            for name in ("KVD_OTEL_TRACES", "OTEL_BSP_SCHEDULE_DELAY",
                         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
                os.environ.pop(name, None)

    assert not soak.failures, soak.failures
    bad = [r.rid for r in soak.requests if r.done and r.outcome != "error" and not r.tokens_ok]
    assert not bad, f"requests that differ from the plain engine's tokens: {bad}"
    for r in soak.requests:
        if r.outcome == "error":
            killed = [f for f in soak.faults if f.kind == "kill_prefill_engine"
                      and f.start <= r.done and r.start <= f.end]
            assert killed and r.prefilled == 0, \
                f"{r.rid} failed ({r.error}) but its engine was not being killed"
        if r.prefill_error:  # progressive: its decode was judged above like any other
            killed = [f for f in soak.faults if f.kind == "kill_prefill_engine"
                      and f.start <= r.done and r.start <= f.end]
            assert killed, f"{r.rid}'s prefill failed ({r.prefill_error}) but its engine " \
                "was not being killed"
    assert report["longest_stall_s"] <= STALL_LIMIT_S, report["longest_stall_s"]
    assert report["longest_plain_token_gap_in_a_fault_s"] <= PLAIN_GAP_LIMIT_S, \
        [(f.kind, round(plain_gap([r for r in soak.requests if r.kind == "plain"], f), 2))
         for f in soak.faults]
    after = report["after_pause"]
    if any(f.kind == "pause_host" for f in soak.faults) and sum(after.values()) >= 3:
        assert after.get("loaded", 0) >= sum(after.values()) // 2, \
            f"P/D did not come back after the host pause: {after}"
    assert not leftover["kvd_shm_left"], leftover["kvd_shm_left"]
    assert not leftover["shm_new_after"], leftover["shm_new_after"]
    assert SOAK_S < 60 or set(report["faults_by_kind"].values()) != {0}
    if TRACES:  # at least 99.9% of handed-over requests end with a complete, linked trace
        traces = report["traces"]
        assert traces["complete_ratio"] is None or traces["complete_ratio"] >= 0.999, \
            traces["incomplete"][:20]

"""``kvd bench vllm``: whole vLLM engines, P/D through kvd and through vLLM's own
NixlConnector, side by side in one run, turns alternating.

The edge of the benchmark: it starts the daemons (``kvd serve``), the vLLM OpenAI
servers (``python -m vllm.entrypoints.openai.api_server``, this interpreter, so run it
from the venv that has vLLM) and one ``kvd router`` per P/D system, sends the
requests, scrapes the decode servers' ``/metrics``, reads the processes' CPU time from
``/proc``, and stops everything it started on every exit path. The arithmetic and the
table are ``vllm_stats``; the systems ``vllm_systems``.

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
import http.client
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvd.errors import KvdError
from kvd.ops.trace import ENV as TRACE_ENV
from kvd.ops.trace import read_traces
from kvd.tools.bench.vllm_stats import (
    TARGET_FIRST_X_WARM,
    Batch,
    Counters,
    Single,
    Summary,
    add_ratios,
    batch_landing,
    breakdown,
    first_transfers,
    median_breakdown,
    summarize,
    targets,
)
from kvd.tools.bench.vllm_systems import SYSTEMS, SystemSpec, engine_args, system_spec
from kvd.tools.bench.vllm_traces import (
    Routed,
    add_trace_measures,
    co_scheduled,
    kvd_parts,
    one_daemon_not_slower_on_kvd_part,
    paired_tails,
    prefill_done_s,
)
from kvd.tools.bench.vllm_turns import Group, Hogs, Turns, cpu_s, session_pids
from kvd.tools.localcluster import DaemonProcess, free_port

HTTP_TIMEOUT_S = 300.0
# An engine or router that exits because another process took its port between the
# pick and the bind (anything else on the host picking free ports: another test's
# `kvd demo`) is started again on a new port, at most this many times.
BIND_TRIES = 3
BIND_FAILED = ("Address already in use", "[Errno 98]")
# A batch's points, in the order a request passes them (the breakdown's landing table).
LANDING_POINTS = ("decode_scheduled", "pull_sent", "daemon_pull", "daemon_event",
                  "daemon_event_sent", "event_taken", "recv_reported")
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
              "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "VLLM_LOGGING_LEVEL": "WARNING"}
CLK_TCK = os.sysconf("SC_CLK_TCK")
WARM_UP_SEED = 90_000  # the engines' own warm-up prompt (rounds: < 50_000, batches above)
IDLE_SETTLE_S = 5.0  # in a system's turn, before its idle CPU is measured


@dataclass(frozen=True)
class BenchConfig:
    systems: tuple[str, ...]
    rounds: int = 8  # single-request rounds (the first is the warm-up)
    batch: int = 6
    batch_rounds: int = 2
    prompt_tokens: int = 800
    max_tokens: int = 16
    kv_cache_bytes: int = 128 << 20
    max_model_len: int = 2048
    idle_s: float = 5.0
    start_parallel: int = 2  # engines starting at once
    start_timeout_s: float = 900.0
    daemon_start_timeout_s: float = 120.0  # each kvd serve answering (a busy host: imports)
    seed: int = 0
    breakdown: bool = False  # kvd engines write connector traces (KVD_TRACE_DIR)
    router_warm_up: bool = False  # routers hand one request over per pair before round 0
    # each engine serves a local request (no transfer) before round 0: round 0 is then
    # a warm pair's first transfer, not also each engine's first request
    engine_warm_up: bool = True
    decode_timeout_s: float = 30.0  # a decode request without its first token by then fails
    max_num_batched_tokens: int = 0  # > 0: chunked prefill of that many tokens a step
    pause_others: bool = True  # between its turns a system is paused (SIGSTOP): a quiet host
    settle_s: float = 1.0  # after a system is continued, before its turn
    hogs: int = 0  # busy loops beside the engines for the whole run (a busy host)
    model_shape: str = "tiny"  # kvd.tools.tiny_model.llama.SHAPES


# ------------------------------------------------------------------ processes

@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, name: str, args: list[str], log_dir: Path,
              env: dict[str, str] | None = None) -> Proc:
        log_path = log_dir / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})},
                                    start_new_session=True)
        return cls(name, proc, log_path)

    def bind_failed(self) -> bool:
        """Whether it exited because its port was taken (its log says so)."""
        return self.proc.poll() is not None and any(m in self.tail(20000)
                                                    for m in BIND_FAILED)

    def tail(self, nchars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-nchars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop its whole session (a vLLM server's engine core and workers too)."""
        stop_session(self.proc)


def stop_session(proc: subprocess.Popen, term_wait_s: float = 20.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; the rest of its session may still be exiting
        deadline = time.monotonic() + wait_s
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not session_pids(proc.pid):
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def session_cpu_s(sid: int) -> float:
    """User + system CPU seconds of every live process of session ``sid``."""
    return cpu_s(session_pids(sid))


# ------------------------------------------------------------------ HTTP

@dataclass
class Stream:
    sent_s: float
    token_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end_s: float = 0.0
    text: str = ""

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.sent_s


def _post(port: int, body: dict[str, Any],
          timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise KvdError(f"POST :{port} answered {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def stream_completion(port: int, body: dict[str, Any],
                      timeout_s: float = HTTP_TIMEOUT_S) -> Stream:
    """A streamed completion: when each chunk with text came, and the text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        payload = json.dumps({**body, "stream": True})
        out = Stream(sent_s=time.monotonic())
        conn.request("POST", "/v1/completions", payload,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise KvdError(f"stream :{port} answered {resp.status}: {resp.read()[:300]!r}")
        parts = []
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = "".join(c.get("text", "") for c in chunk.get("choices", []))
            if text:
                out.token_s.append(time.monotonic())
                parts.append(text)
        out.end_s = time.monotonic()
        out.text = "".join(parts)
        if not out.token_s:
            raise KvdError(f"stream :{port} gave no tokens")
        return out
    finally:
        conn.close()


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _warming(port: int) -> bool:
    """Whether a router started with --warm-up still has a pair pending."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return "pending" in json.loads(conn.getresponse().read()).get("warm", {}).values()
    except (OSError, ValueError):
        return True
    finally:
        conn.close()


def scrape(port: int) -> dict[str, float]:
    """A server's /metrics as {'name{labels}': value} (label order as printed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in metrics.items():
        base = key.split("{", 1)[0]
        if base == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


# ------------------------------------------------------------------ the run

@dataclass
class Running:
    spec: SystemSpec
    ports: dict[str, int]  # role -> server port ("plain" | "prefill" | "decode")
    router_port: int = 0
    procs: list[Proc] = field(default_factory=list)
    daemons: list[DaemonProcess] = field(default_factory=list)


@dataclass
class _Launch:
    """An engine to start: its server's arguments (a port among them) and environment."""

    run: Running
    role: str
    name: str
    args: list[str]
    env: dict[str, str]
    tries: int = 1

    @property
    def port(self) -> int:
        return int(self.args[self.args.index("--port") + 1])

    def rebind(self) -> bool:
        """New ports (the server's, NIXL's side channel) for another try; False when
        it has had its BIND_TRIES."""
        if self.tries >= BIND_TRIES:
            return False
        self.tries += 1
        port = free_port()
        self.args[self.args.index("--port") + 1] = str(port)
        self.run.ports[self.role] = port
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in self.env:
            self.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        return True


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

    # -------------------------------------------------------------- start / stop

    def start(self) -> None:
        pending: list[_Launch] = []
        for name in self.cfg.systems:
            spec = system_spec(name)
            run = Running(spec, {})
            self.systems[name] = run
            homes, peers = {}, {}
            daemon_env = {TRACE_ENV: str(self.work / "trace")} if self.cfg.breakdown else None
            for d in spec.daemons:
                daemon = DaemonProcess.start(d.name, self.work, list(d.extra_args),
                                             env=daemon_env,
                                             timeout_s=self.cfg.daemon_start_timeout_s)
                run.daemons.append(daemon)
                homes[d.name] = daemon.engine_address
                peers[d.name] = daemon.peer_address
            prefill = next((e for e in spec.engines if e.role == "prefill"), None)
            for e in spec.engines:
                port = free_port()
                run.ports[e.role] = port
                cfg = None
                if e.kv_transfer_config is not None:
                    cfg = json.loads(json.dumps(e.kv_transfer_config))
                    if e.daemon is not None:
                        extra = cfg["kv_connector_extra_config"]
                        extra["kvd_address"] = homes[e.daemon]
                        if e.role == "decode" and prefill is not None and prefill.daemon:
                            # as an operator would: the decode names its producer, and
                            # its daemon greets the prefill's ahead of the first pull
                            extra["kvd_producers"] = [{"engine_id": prefill.name,
                                                       "address": peers[prefill.daemon]}]
                env = dict(ENGINE_ENV)
                if self.cfg.breakdown and e.daemon is not None:
                    env[TRACE_ENV] = str(self.work / "trace")
                if e.nixl_side_channel:
                    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
                args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                        *engine_args(self.model, port, self.cfg.kv_cache_bytes,
                                     self.cfg.max_model_len, cfg,
                                     self.cfg.max_num_batched_tokens)]
                pending.append(_Launch(run, e.role, e.name, args, env))
        starting: list[tuple[Proc, _Launch]] = []
        deadline = time.monotonic() + self.cfg.start_timeout_s
        t0 = time.monotonic()
        while pending or starting:
            while pending and len(starting) < self.cfg.start_parallel:
                launch = pending.pop(0)
                proc = Proc.start(launch.name, launch.args, self.work, launch.env)
                launch.run.procs.append(proc)
                starting.append((proc, launch))
            for proc, launch in list(starting):
                if proc.proc.poll() is not None:
                    starting.remove((proc, launch))
                    if not (proc.bind_failed() and launch.rebind()):
                        raise KvdError(f"engine {proc.name} exited with "
                                       f"{proc.proc.returncode}:\n{proc.tail()}")
                    self.log(f"  {proc.name}: its port was taken meanwhile; starting it "
                             f"again on port {launch.port}")
                    pending.insert(0, launch)
                elif _healthy(launch.port):
                    self.log(f"  {proc.name} up after {time.monotonic() - t0:.0f} s")
                    starting.remove((proc, launch))
            if time.monotonic() > deadline:
                raise KvdError(self._not_up(f"engines not up within "
                                            f"{self.cfg.start_timeout_s} s",
                                            [p for p, _ in starting]))
            time.sleep(1.0)
        routers = {name: self._start_router(run) for name, run in self.systems.items()
                   if run.spec.disaggregated}
        for name, run in self.systems.items():
            tries = 1
            while run.router_port and not _healthy(run.router_port):
                proc = routers[name]
                if proc.proc.poll() is not None:
                    if not proc.bind_failed() or tries >= BIND_TRIES:
                        raise KvdError(f"router of {name} exited with "
                                       f"{proc.proc.returncode}:\n{proc.tail()}")
                    tries += 1
                    routers[name] = self._start_router(run)
                if time.monotonic() > deadline:
                    raise KvdError(self._not_up(f"router of {name} not up", [proc]))
                time.sleep(0.2)
            while self.cfg.router_warm_up and run.router_port and _warming(run.router_port):
                if time.monotonic() > deadline:
                    raise KvdError(f"router of {run.spec.name} did not warm its pair up")
                time.sleep(0.2)

    def _start_router(self, run: Running) -> Proc:
        run.router_port = free_port()
        proc = Proc.start(f"{run.spec.name}-router", [
            sys.executable, "-m", "kvd", "router",
            "--prefill", f"http://127.0.0.1:{run.ports['prefill']}",
            "--decode", f"http://127.0.0.1:{run.ports['decode']}",
            "--port", str(run.router_port), *run.spec.router_args,
            *(["--warm-up"] if self.cfg.router_warm_up else [])], self.work)
        run.procs.append(proc)
        return proc

    @staticmethod
    def _not_up(what: str, procs: list[Proc]) -> str:
        """What did not come up, with what tells a starved host from a hang: the
        host's load, and each process's CPU time so far and its log's end."""
        lines = [f"{what} (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus):"]
        for p in procs:
            lines.append(f"--- {p.name}: running, {session_cpu_s(p.proc.pid):.0f} CPU s "
                         f"used so far; log {p.log_path}, its end:\n{p.tail(1500)}")
        return "\n".join(lines)

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
            _stop_system(run)

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
            params = _post(run.ports["prefill"], body,
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
            params = _parallel([lambda s=s, r=run: self._prefill(r, s) for s in seeds])
            calls = [lambda s=s, p=p, r=run: self._decode(r, s, p)
                     for s, p in zip(seeds, params, strict=True)]
        else:
            port = run.ports["plain"]
            calls = [lambda s=s, p=port: stream_completion(p, self._body(s)) for s in seeds]
        got = _parallel(calls)
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
            len(got), failed=len(got) - len(streams)))

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
        _stop_system(self.systems[name])

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
        """Per kvd system: the median stage times of its warm single hand-overs, each
        batch's landing (when each request's pull was sent, its event taken, reported,
        and its first token came) and its co-scheduled spread, and the paired tail of
        its requests through the router (vllm_stats' docstring has both rules)."""
        trace_dir = self.work / "trace"
        points = read_traces(str(trace_dir)) if trace_dir.is_dir() else []
        per_system: dict[str, list[dict[str, float]]] = {}
        for name, stamps in self.timelines:
            if not name.startswith("kvd"):
                continue
            window = [p for p in points
                      if stamps["prefill_sent"] <= p[0] / 1e9 <= stamps["end"]]
            found = dict(stamps)
            copy_s = None
            for ns, point, _rid, value in window:
                if point not in found:
                    found[point] = ns / 1e9
                    if point == "event_taken":
                        copy_s = value
            per_system.setdefault(name, []).append(breakdown(found, copy_s))
        medians = {n: median_breakdown(rows[1:] or rows) for n, rows in per_system.items()}
        landing = []
        co: dict[str, list[Any]] = {}
        for b in self.batches:
            if not b.system.startswith("kvd"):
                continue
            window = [p for p in points if b.sent_s <= p[0] / 1e9 <= max(b.end_s)]
            c = co_scheduled(window, b.step_s)
            co.setdefault(b.system, []).append(c)
            by_point: dict[str, list[float]] = {}
            for ns, point, _rid, _value in window:
                if point in LANDING_POINTS:
                    by_point.setdefault(point, []).append(ns / 1e9)
            by_point["first_token"] = list(b.first_token_s)
            landing.append({"system": b.system, "round": b.round,
                            "step_ms": round(b.step_s * 1000, 1),
                            "co_scheduled": asdict(c),
                            **batch_landing(b.sent_s, by_point)})
        routed = [Routed(name, rnd, sent_s, first_s, prefill_done_s(
            [p for p in points if sent_s <= p[0] / 1e9 <= first_s]))
            for name, rnd, sent_s, first_s in self.routed if name.startswith("kvd")]
        paired = {name: paired_tails([r for r in routed if r.system == name], plain_ttft)
                  for name in dict.fromkeys(r.system for r in routed)}
        return {"breakdown": medians, "breakdown_samples": per_system,
                "first_transfers": first_transfers(per_system), "batch_landing": landing,
                "co_scheduled": co, "paired": paired,
                "routed_samples": [asdict(r) for r in routed]}


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


def _stop_system(run: Running) -> None:
    """Stop a system's processes, the last started first, then its daemons, whatever fails."""
    for proc in reversed(run.procs):
        with contextlib.suppress(Exception):
            proc.stop()
    for d in run.daemons:
        with contextlib.suppress(Exception):
            d.stop()


def _rotated(names: list[str], rnd: int) -> list[str]:
    """The plain engine first (its tokens are the reference), the rest rotated."""
    rest = [n for n in names if n != "plain"]
    k = rnd % len(rest) if rest else 0
    return [n for n in names if n == "plain"] + rest[k:] + rest[:k]


def _parallel(calls: list[Any]) -> list[Any]:
    """Run the calls at once on threads; their results in order (first error raised)."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    gate = threading.Barrier(len(calls))

    def one(i: int) -> None:
        try:
            gate.wait()
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def host_load() -> float:
    return round(os.getloadavg()[0], 2)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run through its cleanup (as Ctrl-C does)."""
    def raise_exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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
        with _signals_raise():
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


def plot(result: dict[str, Any], path: str) -> None:
    """Hand-over p50/p95 and the batch's decode time per system (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in result["summaries"] if s["system"] != "plain"]
    names = [s["system"] for s in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [s["handover_p50_ms"] or 0 for s in rows], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [s["handover_p95_ms"] or 0 for s in rows], 0.4, label="p95")
    a.set_xticks(list(x), names, rotation=20)
    a.set_ylabel("hand-over (decode TTFT), ms")
    a.legend()
    b.bar(list(x), [s["batch_decode_p50_s"] or 0 for s in rows])
    b.set_xticks(list(x), names, rotation=20)
    b.set_ylabel(f"batch of {result['config']['batch']}: decode side, s")
    fig.tight_layout()
    fig.savefig(path)

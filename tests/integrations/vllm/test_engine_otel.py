"""One trace per request, end to end: stock vLLM OpenAI servers with their own OTLP tracing
on (``--otlp-traces-endpoint``), ``kvd router --otel``, both daemons with
``otel_traces=true``, the connector with ``KVD_OTEL_TRACES=true``, all exporting to an
OTLP/HTTP receiver this test runs (tests/support/otlp_receiver.py).

Judged per request: one trace holds the router's span (its root, or a child of the
client's context), vLLM's ``llm_request`` span of the prefill and of the decode engine,
the prefill daemon's ``kvd.hold``, the decode daemon's ``kvd.pull`` with its phases, and
the decode connector's ``kvd.wait_kv`` and ``first_step``; every one of them a
child of the router's span (the pull's phases of the pull), from four processes besides
the router. Hold ``flock /tmp/kvd-vllm.lock`` while it runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cluster import wait_until
from support.otlp_receiver import OtlpReceiver, SpanRecord, waterfall

from kvd.tools.localcluster import DaemonProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 600.0
REQUESTS = 3
PULL_PHASES = {"kvd.wait_ranks", "kvd.greet", "kvd.acquire", "kvd.assemble", "kvd.read",
               "kvd.post", "kvd.quarantine", "kvd.report"}
CLIENT_TP = "00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-01"


def _popen(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):  # noqa: S310
            return True
    except OSError:
        return False


class Stack:
    def __init__(self, receiver: OtlpReceiver, router_url: str, logs: Path) -> None:
        self.receiver, self.router_url, self.logs = receiver, router_url, logs

    def complete(self, body: dict, headers: dict[str, str] | None = None) -> dict:
        req = urllib.request.Request(self.router_url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310
            return json.loads(resp.read())

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.logs.glob("*.log")))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("otel-e2e")
    receiver = OtlpReceiver()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "200", "KVD_OTEL_TRACES": "true",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [
               os.environ.get("PYTHONPATH")])])}
    model = work / "model"
    subprocess.run([sys.executable, "-m", "kvd", "tiny-model", str(model)], check=True,
                   env=env, timeout=300, capture_output=True)
    procs: list[subprocess.Popen[bytes]] = []
    daemons: list[DaemonProcess] = []
    try:
        for name in ("otelp", "oteld"):
            daemons.append(DaemonProcess.start(f"{name}-{os.getpid()}", work,
                                               extra_args=["--set", "otel_traces=true"],
                                               env=env))
        ports = []
        for role, daemon in zip(("prefill-0", "decode-0"), daemons, strict=True):
            port = free_port()
            ports.append(port)
            kv = json.dumps({"kv_connector": "KvdConnector",
                             "kv_connector_module_path": "kvd.integrations.vllm",
                             "kv_role": "kv_both", "engine_id": role,
                             "kv_connector_extra_config": {
                                 "kvd_address": daemon.engine_address}})
            procs.append(_popen([
                sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--port", str(port), "--dtype", "float32",
                "--enforce-eager", "--block-size", "32", "--max-model-len", "2048",
                "--kv-cache-memory-bytes", "67108864", "--no-enable-prefix-caching",
                "--otlp-traces-endpoint", receiver.url, "--kv-transfer-config", kv],
                work / f"{role}.log", env))
        router_port = free_port()
        procs.append(_popen([
            sys.executable, "-m", "kvd", "router", "--otel", "--port", str(router_port),
            "--prefill", f"http://127.0.0.1:{ports[0]}",
            "--decode", f"http://127.0.0.1:{ports[1]}"], work / "router.log", env))
        stack = Stack(receiver, f"http://127.0.0.1:{router_port}", work)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for url in (f"http://127.0.0.1:{p}" for p in (*ports, router_port)):
            while not _healthy(url):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    pytest.fail(f"{url} did not start:\n{stack.log_tails()}")
                time.sleep(2)
        yield stack
    finally:
        for p in procs:
            _stop(p)
        for d in daemons:
            d.stop()
        receiver.close()


def _trace(spans: list[SpanRecord], trace_id: str) -> list[SpanRecord]:
    return [s for s in spans if s.trace_id == trace_id]


def test_one_trace_per_request_from_router_through_both_daemons_and_engines(
        stack: Stack) -> None:
    prompt = " ".join(f"t{i}" for i in range(3, 130))
    body = {"model": str(stack.logs / "model"), "prompt": prompt, "max_tokens": 8,
            "temperature": 0}
    for i in range(REQUESTS):
        out = stack.complete(body, {"traceparent": CLIENT_TP} if i == 0 else None)
        assert out["choices"][0]["text"], out

    def routers() -> list[SpanRecord]:
        return [s for s in stack.receiver.snapshot() if s.name == "kvd.router"]

    wait_until(lambda: len(routers()) >= REQUESTS, timeout_s=60, what="the router's spans")

    def complete_traces() -> bool:
        spans = stack.receiver.snapshot()
        names = [{s.name for s in _trace(spans, r.trace_id)} for r in routers()]
        return all({"llm_request", "kvd.hold", "kvd.pull", "kvd.wait_kv",
                    "kvd.first_step"} <= n for n in names)

    try:
        wait_until(complete_traces, timeout_s=60, what="every trace complete")
    finally:
        spans = stack.receiver.snapshot()
        for r in routers():
            print(f"trace {r.trace_id}\n{waterfall(_trace(spans, r.trace_id))}")
    traces = {r.trace_id: r for r in routers()}
    assert len(traces) == REQUESTS  # one trace per request
    assert CLIENT_TP[3:35] in traces and traces[CLIENT_TP[3:35]].parent_id == CLIENT_TP[36:52]
    for trace_id, router in traces.items():
        spans = _trace(stack.receiver.snapshot(), trace_id)
        by_name: dict[str, list[SpanRecord]] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        engines = by_name["llm_request"]
        assert len(engines) == 2, [s.resource for s in engines]  # prefill and decode
        (hold,) = by_name["kvd.hold"]
        (pull,) = by_name["kvd.pull"]
        (wait,) = by_name["kvd.wait_kv"]
        for child in (*engines, hold, pull, wait, *by_name["kvd.first_step"]):
            assert child.parent_id == router.span_id, (child.name, child.service)
        assert hold.resource["kvd.daemon_id"] != pull.resource["kvd.daemon_id"]
        assert hold.attributes["kvd.outcome"] == pull.attributes["kvd.outcome"] == "ok"
        phases = [s for s in spans if s.name in PULL_PHASES]
        assert {"kvd.acquire", "kvd.read", "kvd.report"} <= {
            s.name for s in phases}
        assert all(s.parent_id == pull.span_id for s in phases)
        assert router.start_ns <= pull.start_ns and pull.end_ns <= router.end_ns

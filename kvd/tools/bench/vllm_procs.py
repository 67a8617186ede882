"""The processes and HTTP of ``kvd bench vllm`` (kvd.tools.bench.vllm_run): a started
process and its session, stopped whole; the OpenAI server's completions, streamed or
not, its health and /metrics; calls at once on threads; signals that end a run through
its cleanup. The standard library's HTTP only: no vLLM or aiohttp import.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd.errors import KvdError
from kvd.tools.bench.vllm_turns import cpu_s, session_pids

HTTP_TIMEOUT_S = 300.0
BIND_FAILED = ("Address already in use", "[Errno 98]")


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

    def port_taken(self) -> bool:
        """Whether its log says a port of its was taken, exited or not (vLLM's NIXL
        handshake listener is a thread: when its bind fails the server lives on and
        never comes up)."""
        return any(m in self.tail(20000) for m in BIND_FAILED)

    def bind_failed(self) -> bool:
        """Whether it exited because its port was taken (its log says so)."""
        return self.proc.poll() is not None and self.port_taken()

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


def post_completion(port: int, body: dict[str, Any],
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


def healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def warming(port: int) -> bool:
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


def parallel(calls: list[Any]) -> list[Any]:
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
def signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run through its cleanup (as Ctrl-C does)."""
    def raise_exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)

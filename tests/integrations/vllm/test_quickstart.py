"""docs/vllm.md's quickstart, run as written: one `kvd serve`, a prefill and a decode vLLM
OpenAI server with the connector, `kvd router`, requests, metrics.

The documented blocks run as one bash script (``quickstart.script``: only the ports and
the work directory change), plus a plain server (no connector) for the expected answers.
Then, through the router: the documented completion, a streamed completion and a chat
completion, each compared token for token with the plain server (greedy, the tiny
prompt-sensitive model), and the decode server's metrics: every prompt token loaded
through kvd (``local_compute`` 0), one kvd pull per request. Last, the documented stop
step: every process the quickstart started is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import quickstart

from kvd.tools.localcluster import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 120.0
DONE = quickstart.DONE


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    out_path: Path
    work: Path
    ports: dict[int, int]
    plain_port: int

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def url(self, documented_port: int) -> str:
        return f"http://127.0.0.1:{self.ports[documented_port]}"

    def logs(self) -> str:
        tails = [f"--- quickstart output\n{self.output()[-3000:]}"]
        for log in sorted(self.work.glob("*.log")):
            tails.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(tails)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    work = tmp_path_factory.mktemp("quickstart")
    ports = {p: free_port() for p in quickstart.PORTS}
    plain_port = free_port()
    text = quickstart.script(ports, work, Path(sys.executable).parent)
    # The plain server for expected answers starts with the others (startup overlaps).
    serve_plain = (
        f"python -m vllm.entrypoints.openai.api_server --model $QS/model --port {plain_port} "
        "--dtype float32 --enforce-eager --block-size 32 --max-model-len 2048 "
        "--kv-cache-memory-bytes 67108864 --no-enable-prefix-caching > $QS/plain.log 2>&1 &\n")
    text = text.replace("echo '=== quickstart:daemons'", serve_plain
                        + "echo '=== quickstart:daemons'", 1)
    script = work / "quickstart.sh"
    # The plain server is the script's job too: the documented stop step stops it.
    script.write_text("set -u\n" + text + "\necho '=== quickstart:stopped'\n")
    out_path = work / "quickstart.out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env=env, start_new_session=True)
    run = Running(proc, out_path, work, ports, plain_port)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while DONE not in run.output():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"quickstart did not finish (rc={proc.poll()}):\n{run.logs()}")
            time.sleep(1)
        _wait_healthy(f"http://127.0.0.1:{plain_port}", deadline)
        yield run
    finally:
        left = _documented_stop(run)
        _stop(proc)
        print(run.logs())
    assert not left, f"the quickstart's stop step left these running: {left}"


def _session(sid: int) -> list[str]:
    """'pid name' of every live process in session ``sid`` (the quickstart's)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(f"{entry} {name.split('(', 1)[1]}")
        except (OSError, ValueError, IndexError):
            continue
    return out


def _documented_stop(run: Running) -> list[str]:
    """Run the quickstart's stop step (create $QS/stop) and wait for the script to end;
    what of its session still runs then (only the script itself may, if it hangs)."""
    (run.work / quickstart.STOP_FILE).touch()
    try:
        run.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(2)  # processes the servers were still reaping
    return [p for p in _session(run.proc.pid) if not p.startswith(f"{run.proc.pid} ")]


def _wait_healthy(url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            time.sleep(1)  # the group's other members
        except subprocess.TimeoutExpired:
            continue


def _post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        return resp.read()


def _stream_text(raw: bytes) -> str:
    """The text of an OpenAI server-sent-event stream of completion chunks."""
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _words(first: int, count: int) -> str:
    return " ".join(f"t{i}" for i in range(first, first + count))


def test_quickstart_completion_matches_a_plain_server_and_nothing_is_recomputed(
        running: Running) -> None:
    out = running.output()
    answer = out.split("=== quickstart:request", 1)[1].split("=== quickstart:metrics", 1)[0]
    routed = json.loads(answer.strip().splitlines()[-1])
    model = str(running.work / "model")
    body = {"model": model, "prompt": _words(3, 128) + " ", "max_tokens": 12, "temperature": 0}
    plain = json.loads(_post(f"http://127.0.0.1:{running.plain_port}/v1/completions", body))
    assert routed["choices"][0]["text"] == plain["choices"][0]["text"]
    assert plain["choices"][0]["text"].strip()

    # The documented metrics block printed the proof.
    shown = out.split("=== quickstart:metrics", 1)[1]
    assert _metric(shown, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert _metric(shown, "vllm:prompt_tokens_by_source_total",
                   source="external_kv_transfer") == 128
    assert _metric(shown, "vllm:kvd_pulls_total") == 1
    assert _metric(shown, "vllm:kvd_pulled_bytes_total") > 0
    # one daemon for both servers: the pull was a copy inside it
    assert _metric(shown, "kvd_transfers_total", role="consumer", path="local",
                   outcome="ok") == 1
    assert _metric(shown, "kvd_transfers_total", role="consumer", path="remote") == 0


def test_streamed_and_chat_requests_through_the_router(running: Running) -> None:
    model = str(running.work / "model")
    router, plain = running.url(8000), f"http://127.0.0.1:{running.plain_port}"
    stream = {"model": model, "prompt": _words(200, 150), "max_tokens": 10,
              "temperature": 0, "stream": True}
    got = _stream_text(_post(router + "/v1/completions", stream))
    want = _stream_text(_post(plain + "/v1/completions", stream))
    assert got == want and want.strip()

    chat = {"model": model, "messages": [{"role": "user", "content": _words(360, 100)}],
            "max_tokens": 8, "temperature": 0}
    got_chat = json.loads(_post(router + "/v1/chat/completions", chat))
    want_chat = json.loads(_post(plain + "/v1/chat/completions", chat))
    assert (got_chat["choices"][0]["message"]["content"]
            == want_chat["choices"][0]["message"]["content"])

    with urllib.request.urlopen(running.url(8200) + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert _metric(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert _metric(metrics, "vllm:kvd_pulls_total") == 3
    assert _metric(metrics, "vllm:kvd_pulls_failed_total") == 0
    assert re.search(r"vllm:kvd_descriptors_total\{[^}]*\} [1-9]", metrics)

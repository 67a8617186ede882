"""`kvd router` against fake OpenAI servers: the hand-off, streaming, round-robin, and every
way the prefill step fails (one JSON error naming the server; the decode never called).

aiohttp is the router's optional dependency (``kvd[router]``; vLLM installs it): these
tests skip where it is absent (the plain ``.venv``) and run in ``.venv-vllm``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from kvd.tools.localcluster import free_port  # noqa: E402
from kvd.tools.router.app import Router, RouterConfig, prefill_request  # noqa: E402

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[3, 4], [7]], "kvd_receipt": "r-1",
          "nested": {"opaque": [1, 2.5, None]}}


class FakeServer:
    """An OpenAI-ish server that records what it was sent."""

    def __init__(self, name: str, role: str, delay_s: float = 0.0, status: int = 200,
                 params: Any = PARAMS) -> None:
        self.name, self.role, self.delay_s, self.status, self.params = (
            name, role, delay_s, status, params)
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} broke"}},
                                     status=self.status)
        if self.role == "prefill":
            return web.json_response({"id": "p", "kv_transfer_params": self.params})
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(3):
                await out.write(f"data: {json.dumps({'n': i, 'by': self.name})}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        return web.json_response({"by": self.name, "params": body.get("kv_transfer_params")})

    async def models(self, _request: web.Request) -> web.Response:
        if self.status != 200:  # a server still starting
            return web.json_response({}, status=503)
        return web.json_response({"data": [{"id": f"model-of-{self.name}"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app


@asynccontextmanager
async def routed(prefills: list[FakeServer], decodes: list[FakeServer],
                 extra_prefill_urls: tuple[str, ...] = (),
                 **cfg: Any) -> AsyncIterator[TestClient]:
    servers = [TestServer(s.app()) for s in (*prefills, *decodes)]
    for s in servers:
        await s.start_server()
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    router = Router(RouterConfig(tuple(urls[:len(prefills)]) + extra_prefill_urls,
                                 tuple(urls[len(prefills):]), **cfg))
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        for s in servers:
            await s.close()


def run(coro: Callable[[], Any]) -> None:
    asyncio.run(coro())


def test_prefill_step_asks_for_one_token_and_a_remote_decode() -> None:
    body = {"model": "m", "prompt": "t5 t6", "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    out = prefill_request(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 20  # the client's body is not changed


def test_completion_hands_the_params_over_untouched() -> None:
    async def go() -> None:
        p, d = FakeServer("p0", "prefill"), FakeServer("d0", "decode")
        async with routed([p], [d]) as client:
            resp = await client.post("/v1/completions",
                                     json={"model": "m", "prompt": "t5", "max_tokens": 7})
            assert resp.status == 200
            assert await resp.json() == {"by": "d0", "params": PARAMS}
        assert p.seen[0]["max_tokens"] == 1
        assert d.seen[0]["max_tokens"] == 7 and d.seen[0]["kv_transfer_params"] == PARAMS

    run(go)


def test_streamed_chat_passes_through_chunk_by_chunk() -> None:
    async def go() -> None:
        p, d = FakeServer("p0", "prefill"), FakeServer("d0", "decode")
        async with routed([p], [d]) as client:
            resp = await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and [json.loads(e)["n"] for e in events[:-1]] == [0, 1, 2]
        assert p.seen[0]["stream"] is False and d.seen[0]["stream"] is True

    run(go)


def test_round_robin_over_prefill_and_decode_urls() -> None:
    async def go() -> None:
        ps = [FakeServer(f"p{i}", "prefill") for i in range(2)]
        ds = [FakeServer(f"d{i}", "decode") for i in range(2)]
        async with routed(ps, ds) as client:
            for _ in range(4):
                resp = await client.post("/v1/completions", json={"prompt": "t5"})
                assert resp.status == 200
        assert [len(s.seen) for s in (*ps, *ds)] == [2, 2, 2, 2]

    run(go)


@pytest.mark.parametrize(("case", "status", "named"), [
    ("error", 502, "answered 500: p0 broke"),
    ("bad_request", 400, "answered 400: p0 broke"),
    ("timeout", 504, "no answer within prefill_timeout_s=0.2"),
    ("no_params", 502, "without kv_transfer_params"),
])
def test_prefill_failure_is_one_error_and_no_decode(case: str, status: int, named: str) -> None:
    async def go() -> None:
        p = FakeServer("p0", "prefill", delay_s=1.0 if case == "timeout" else 0.0,
                       status={"error": 500, "bad_request": 400}.get(case, 200),
                       params=None if case == "no_params" else PARAMS)
        d = FakeServer("d0", "decode")
        async with routed([p], [d], prefill_timeout_s=0.2) as client:
            resp = await client.post("/v1/completions", json={"prompt": "t5"})
            assert resp.status == status
            err = (await resp.json())["error"]
        assert err["type"] == "prefill_failed" and named in err["message"], err
        assert err["message"].startswith("prefill http://127.0.0.1:")
        assert d.seen == []

    run(go)


def test_unreachable_prefill_is_named_and_the_next_one_serves() -> None:
    async def go() -> None:
        p, d = FakeServer("p0", "prefill"), FakeServer("d0", "decode")
        dead = f"http://127.0.0.1:{free_port()}"
        async with routed([p], [d], extra_prefill_urls=(dead,)) as client:
            first = await client.post("/v1/completions", json={"prompt": "t5"})
            second = await client.post("/v1/completions", json={"prompt": "t5"})
            assert first.status == 200
            assert second.status == 502
            assert (await second.json())["error"]["message"].startswith(f"prefill {dead}")

    run(go)


def test_warm_up_hands_one_request_over_between_every_pair_before_traffic() -> None:
    async def go() -> None:
        ps = [FakeServer(f"p{i}", "prefill") for i in range(2)]
        ds = [FakeServer("d0", "decode")]
        async with routed(ps, ds, warm_up=True) as client:
            for _ in range(100):
                health = await (await client.get("/health")).json()
                if "pending" not in health["warm"].values():
                    break
                await asyncio.sleep(0.02)
            assert sorted(health["warm"].values()) == ["ok", "ok"]
        assert [len(p.seen) for p in ps] == [1, 1]
        assert ps[0].seen[0]["model"] == "model-of-p0"
        assert ps[0].seen[0]["kv_transfer_params"] == {"do_remote_decode": True}
        assert ps[0].seen[0]["max_tokens"] == 1
        assert [d["kv_transfer_params"] for d in ds[0].seen] == [PARAMS, PARAMS]

    run(go)


def test_warm_up_waits_for_a_server_still_starting_and_is_off_by_default() -> None:
    async def go() -> None:
        p, d = FakeServer("p0", "prefill", status=503), FakeServer("d0", "decode")
        async with routed([p], [d], warm_up=True) as client:
            await asyncio.sleep(0.1)
            health = await (await client.get("/health")).json()
            assert list(health["warm"].values()) == ["pending"]
            p.status = 200  # it came up
            for _ in range(200):
                health = await (await client.get("/health")).json()
                if list(health["warm"].values()) == ["ok"]:
                    break
                await asyncio.sleep(0.02)
            assert list(health["warm"].values()) == ["ok"]
        p2, d2 = FakeServer("p1", "prefill"), FakeServer("d1", "decode")
        async with routed([p2], [d2]) as client:
            await asyncio.sleep(0.05)
            assert "warm" not in await (await client.get("/health")).json()
        assert p2.seen == [] and d2.seen == []

    run(go)


class TraceSeen(FakeServer):
    """A fake server that records the traceparent header of each request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.headers: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(request.headers.get("traceparent", ""))
        return await super().handle(request)


CLIENT_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_trace_context_goes_to_both_engines_new_or_the_clients() -> None:
    """No traceparent from the client: the router starts a trace, and sends the same
    context to the prefill (header and kv_transfer_params) and the decode (header); the
    client's own is passed on as it is."""
    async def go() -> None:
        p = TraceSeen("p0", "prefill")
        d = TraceSeen("d0", "decode")
        async with routed([p], [d]) as client:
            for headers in ({}, {"traceparent": CLIENT_TP}):
                resp = await client.post("/v1/completions", headers=headers,
                                         json={"model": "m", "prompt": "t5", "max_tokens": 7})
                assert resp.status == 200
        new, given = p.headers
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", new), new
        assert given == CLIENT_TP
        assert d.headers == [new, CLIENT_TP]
        assert [s["kv_transfer_params"]["traceparent"] for s in p.seen] == [new, CLIENT_TP]
        assert d.seen[0]["kv_transfer_params"] == PARAMS  # the prefill's, untouched

    run(go)


def test_with_otel_the_routers_span_is_the_engines_parent() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvd.ops.otel import RequestSpans

    async def go() -> None:
        p, d = TraceSeen("p0", "prefill"), TraceSeen("d0", "decode")
        exporter = InMemorySpanExporter()
        servers = [TestServer(s.app()) for s in (p, d)]
        for s in servers:
            await s.start_server()
        router = Router(RouterConfig((f"http://127.0.0.1:{servers[0].port}",),
                                     (f"http://127.0.0.1:{servers[1].port}",)))
        router.spans = RequestSpans(exporter=exporter)
        client = TestClient(TestServer(router.app()))
        await client.start_server()
        try:
            resp = await client.post("/v1/completions", headers={"traceparent": CLIENT_TP},
                                     json={"model": "m", "prompt": "t5", "max_tokens": 7})
            assert resp.status == 200
        finally:
            await client.close()
            for s in servers:
                await s.close()
        router.spans.provider.force_flush()
        (span,) = exporter.get_finished_spans()
        assert f"{span.context.trace_id:032x}" == CLIENT_TP[3:35]
        assert f"{span.parent.span_id:016x}" == CLIENT_TP[36:52]
        sent = f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"
        assert p.headers == [sent] and d.headers == [sent]


IDENTITY = {"do_remote_prefill": True, "remote_engine_id": "pre-engine",
            "kvd_address": "tcp://10.0.0.1:7101", "kvd_format": 1}


def test_progressive_sends_to_both_at_once_once_the_prefill_is_known() -> None:
    """The first request learns the prefill's kvd identity (sequential); the next go to
    the prefill and the decode at once, the decode's params naming the prefill engine, its
    daemon and the transfer id the prefill seals under."""
    async def go() -> None:
        p = FakeServer("p0", "prefill", delay_s=3.0, params=IDENTITY)
        d = FakeServer("d0", "decode")
        async with routed([p], [d], progressive=True) as client:
            first = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
            assert (await first.json())["params"] == IDENTITY  # sequential: as answered
            t0 = asyncio.get_running_loop().time()
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "b"})
            took = asyncio.get_running_loop().time() - t0
            assert resp.status == 200
            sent = (await resp.json())["params"]
            assert took < 2.5, "the decode waited for the prefill"
            health = await (await client.get("/health")).json()
        pre = p.seen[1]["kv_transfer_params"]
        assert pre["do_remote_decode"] and pre["kvd_progressive"]
        # both engines get the request's one trace context
        assert sent.pop("traceparent") == pre["traceparent"]
        assert sent == {"do_remote_prefill": True, "do_remote_decode": False,
                        "kvd_progressive": True, "remote_engine_id": "pre-engine",
                        "remote_request_id": pre["kvd_transfer_id"],
                        "kvd_address": "tcp://10.0.0.1:7101", "kvd_format": 1}
        assert p.seen[1]["max_tokens"] == 1
        assert health["progressive"] == {health["prefill"][0]: True}

    run(go)


def test_progressive_prefill_failure_cancels_the_decode() -> None:
    async def go() -> None:
        p = FakeServer("p0", "prefill", params=IDENTITY)
        d = FakeServer("d0", "decode", delay_s=5.0)
        async with routed([p], [d], progressive=True) as client:
            await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
            d.delay_s, p.status = 5.0, 500
            t0 = asyncio.get_running_loop().time()
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "b"})
            assert resp.status == 502 and "p0 broke" in (await resp.json())["error"]["message"]
            assert asyncio.get_running_loop().time() - t0 < 3.0

    run(go)


def test_sequential_stays_the_default() -> None:
    async def go() -> None:
        p, d = FakeServer("p0", "prefill", params=IDENTITY), FakeServer("d0", "decode")
        async with routed([p], [d]) as client:
            for prompt in ("a", "b"):
                await client.post("/v1/completions", json={"model": "m", "prompt": prompt})
        # sequential: no progressive keys (only the trace context beside the request)
        assert all({k: v for k, v in s["kv_transfer_params"].items() if k != "traceparent"}
                   == {"do_remote_decode": True} for s in p.seen)
        assert all(s["kv_transfer_params"] == IDENTITY for s in d.seen)

    run(go)

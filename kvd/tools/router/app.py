"""`kvd router`: a small OpenAI-compatible prefill/decode router for vLLM engines.

Two modes. Sequential (the default, vLLM's standard two-step hand-off): each request
goes first to a prefill server with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then to a decode server with the
``kv_transfer_params`` the prefill answered, copied as they are (opaque: the router
never reads what the connector put there). Completions and chat completions, streamed or
not; round-robin over several prefill and several decode URLs; a timeout on every
upstream call; a prefill that fails is one JSON error naming the server and why, and the
decode step is not tried. Fan-out (one prefill read by several decodes) is out of scope.

Progressive (``--progressive``): the request goes to the prefill and the decode server at
once. The router assigns a transfer id; the prefill's ``kv_transfer_params`` ask it to
seal its chunks under that id, the decode's name the prefill engine, its daemon and the
id (kvd.integrations.connector_core.params.ProgressivePrefill), so the decode's daemon
reads each chunk's KV while the prefill computes the next. The router learns each
prefill server's kvd engine id and daemon address from its first sequential hand-off
(the warm-up, or the first request sent to it): until then that server is used
sequentially. A prefill that fails cancels the decode request (its connector then
cancels the pull).

Why aiohttp: one library is both the async HTTP server and the streaming client, with
connect/read/total timeouts built in; vLLM already installs it, so a vLLM host needs
nothing new (elsewhere: ``pip install 'kvd[router]'``). FastAPI + uvicorn + httpx would
be three packages for the same ~150 lines; the standard library has no streaming async
client. aiohttp is imported by this module only, never by the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from kvd.integrations.connector_core.params import ProgressivePrefill
from kvd.ops.tracecontext import traceparent_or_new

log = logging.getLogger("kvd.router")

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Keys of an OpenAI request that limit the output: the prefill step asks for one token.
MAX_TOKEN_KEYS = ("max_tokens", "max_completion_tokens")
# Response headers not copied from an upstream (aiohttp sets its own framing).
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding",
               "keep-alive", "date", "server"}


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    connect_timeout_s: float = 10.0
    prefill_timeout_s: float = 300.0  # the whole prefill call (prompt computed, KV published)
    decode_read_timeout_s: float = 300.0  # silence between two chunks of the decode answer
    api_key: str = ""  # sent upstream as ``Authorization: Bearer`` when set
    # Hand one small request over between every (prefill, decode) pair as soon as both
    # answer, before traffic: the pair's first transfer (connector handshake, pool
    # mapping, transfer planning, the decode engine's first remote-KV step) is paid then.
    warm_up: bool = False
    warm_up_timeout_s: float = 600.0  # how long to keep trying a pair that does not answer
    # Export a span per request (kvd.ops.otel, OTEL_EXPORTER_OTLP_*): the parent of both
    # engines' and both daemons' spans. Off, the router still passes a trace context on
    # (the client's, or a new one).
    otel: bool = False
    # Send each request to the prefill and the decode at once (progressive pulls); the
    # sequential hand-off stays for prefill servers whose kvd identity is not known yet.
    progressive: bool = False


WARM_UP_PROMPT = " ".join(["kvd router warm-up"] * 16)  # a few blocks of any tokenizer
WARM_UP_RETRY_S = 0.5


def normalize_url(url: str) -> str:
    """``host:port`` means ``http://host:port``; no trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


class RoundRobin:
    """The next URL of a fixed list, in turn (requests spread evenly, no state per URL)."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("at least one URL is required")
        self.urls = tuple(normalize_url(u) for u in urls)
        self._next: Iterator[str] = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._next)


class UpstreamError(Exception):
    """A prefill step that cannot hand off: the client gets ``status`` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def prefill_request(body: dict[str, Any], traceparent: str = "") -> dict[str, Any]:
    """The prefill step's body: one token, not streamed, asking for a remote decode (with
    the request's trace context, which the prefill's connector passes to its daemon and
    on to the decode side)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    for key in MAX_TOKEN_KEYS:
        if key in body or key == "max_tokens":
            out[key] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    if traceparent:
        out["kv_transfer_params"]["traceparent"] = traceparent
    return out


def progressive_prefill_request(body: dict[str, Any], transfer_id: str,
                                traceparent: str = "") -> dict[str, Any]:
    """The prefill's body in progressive mode: as sequential, sealed under ``transfer_id``."""
    out = prefill_request(body, traceparent)
    out["kv_transfer_params"].update(kvd_progressive=True, kvd_transfer_id=transfer_id)
    return out


def decode_request(body: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The client's body as sent, plus the prefill's ``kv_transfer_params`` untouched."""
    return {**body, "kv_transfer_params": kv_transfer_params}


def error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": None}}


class Router:
    """The two-step hand-off over one shared aiohttp client session."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.prefill = RoundRobin(cfg.prefill_urls)
        self.decode = RoundRobin(cfg.decode_urls)
        self.session: ClientSession | None = None
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # (prefill URL, decode URL) -> "ok", "pending" or why it failed (warm_up only)
        self.warm: dict[str, str] = {}
        # prefill URL -> (its kvd engine id, its daemon's peer address), learned from
        # its kv_transfer_params (progressive mode)
        self.identity: dict[str, tuple[str, str]] = {}
        self._warming: asyncio.Task[None] | None = None
        self.spans: Any = None  # kvd.ops.otel.RequestSpans with cfg.otel

    async def start(self, _app: web.Application) -> None:
        self.session = ClientSession(headers=self.headers)
        if self.cfg.otel:
            from kvd.ops.otel import RequestSpans

            self.spans = RequestSpans()
        if self.cfg.warm_up:
            self.warm = {f"{p} -> {d}": "pending" for p in self.prefill.urls
                         for d in self.decode.urls}
            self._warming = asyncio.create_task(self._warm_all())

    async def close(self, _app: web.Application) -> None:
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
        if self.session is not None:
            await self.session.close()
        if self.spans is not None:
            self.spans.shutdown()  # the last spans exported

    async def _warm_all(self) -> None:
        await asyncio.gather(*(self._warm_pair(p, d) for p in self.prefill.urls
                               for d in self.decode.urls))

    async def _warm_pair(self, prefill: str, decode: str) -> None:
        """One hand-over from ``prefill`` to ``decode`` (retried until both answer)."""
        key = f"{prefill} -> {decode}"
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self.cfg.warm_up_timeout_s
        assert self.session is not None
        while True:
            try:
                async with self.session.get(prefill + "/v1/models",
                                            timeout=self._timeout(10.0)) as resp:
                    model = (await resp.json())["data"][0]["id"]
                body = {"model": model, "prompt": WARM_UP_PROMPT, "max_tokens": 1,
                        "temperature": 0}
                async with self.session.post(prefill + "/v1/completions",
                                             json=prefill_request(body),
                                             timeout=self._timeout(
                                                 self.cfg.prefill_timeout_s)) as resp:
                    params = (await resp.json()).get("kv_transfer_params")
                if not params:
                    raise UpstreamError(502, "prefill answered without kv_transfer_params")
                self._learn(prefill, params)
                async with self.session.post(decode + "/v1/completions",
                                             json=decode_request(body, params),
                                             timeout=self._timeout(
                                                 self.cfg.prefill_timeout_s)) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise UpstreamError(resp.status, f"decode answered {resp.status}")
                self.warm[key] = "ok"
                log.info("warmed up %s", key)
                return
            except (ClientError, TimeoutError, UpstreamError, ValueError, KeyError,
                    IndexError, TypeError) as exc:
                if loop.time() >= deadline_s:
                    self.warm[key] = f"failed: {_reason(exc)}"
                    log.warning("warm-up of %s failed: %s", key, _reason(exc))
                    return
                await asyncio.sleep(WARM_UP_RETRY_S)  # a server still starting

    def app(self) -> web.Application:
        app = web.Application()
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        out: dict[str, Any] = {"prefill": list(self.prefill.urls),
                               "decode": list(self.decode.urls)}
        if self.cfg.progressive:
            out["progressive"] = {u: u in self.identity for u in self.prefill.urls}
        if self.cfg.warm_up:
            out["warm"] = self.warm
        return web.json_response(out)

    async def models(self, _request: web.Request) -> web.Response:
        url = self.decode.pick() + "/v1/models"
        assert self.session is not None
        try:
            async with self.session.get(url, timeout=self._timeout(
                    self.cfg.prefill_timeout_s)) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type="application/json")
        except (ClientError, TimeoutError) as exc:
            return _json_error(502, f"decode {url}: {_reason(exc)}", "upstream_unavailable")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _json_error(400, "request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _json_error(400, "request body must be a JSON object",
                               "invalid_request_error")
        # One trace per request: the client's, else a new one; with cfg.otel the router's
        # own span is the parent both engines (HTTP header, vLLM's tracing) and both
        # daemons (kv_transfer_params -> Publish, Pull) join.
        traceparent = request.headers.get("traceparent", "")
        span = None
        if self.spans is not None:
            span, traceparent = self.spans.start("kvd.router", traceparent,
                                                 {"http.route": request.path})
        else:
            traceparent = traceparent_or_new(traceparent)
        error = ""
        try:
            prefill = self.prefill.pick()
            if self.cfg.progressive and prefill in self.identity:
                out = await self._progressive(request, body, prefill, traceparent)
            else:
                try:
                    params = await self._prefill(request.path, body, traceparent, prefill)
                except UpstreamError as exc:
                    log.warning("%s", exc)
                    error = f"prefill: {exc}"
                    return _json_error(exc.status, str(exc), "prefill_failed")
                self._learn(prefill, params)
                out = await self._decode(request, decode_request(body, params), traceparent)
            if out.status != 200:
                error = f"decode answered {out.status}"
            return out
        finally:
            if span is not None:
                self.spans.end(span, error)

    def _learn(self, prefill: str, params: Any) -> None:
        """A prefill server's kvd identity, from the params its connector returned."""
        if not self.cfg.progressive or not isinstance(params, dict):
            return
        engine, address = params.get("remote_engine_id"), params.get("kvd_address")
        if isinstance(engine, str) and engine and isinstance(address, str) and address:
            self.identity[prefill] = (engine, address)

    async def _progressive(self, request: web.Request, body: dict[str, Any],
                           prefill: str, traceparent: str = "") -> web.StreamResponse:
        """Prefill and decode at once; the decode's daemon reads the prefill's chunks as
        they are sealed. A prefill that fails before the decode answers cancels it."""
        engine, address = self.identity[prefill]
        tid = f"kvd-{uuid.uuid4().hex}"
        params = ProgressivePrefill(engine_id=engine, request_id=tid,
                                    address=address).to_params()
        if traceparent:
            params["traceparent"] = traceparent
        pre = asyncio.create_task(self._prefill(
            request.path, body, traceparent, prefill,
            progressive_prefill_request(body, tid, traceparent)))
        dec = asyncio.create_task(self._decode(request, decode_request(body, params),
                                               traceparent))
        done, _ = await asyncio.wait({pre, dec}, return_when=asyncio.FIRST_COMPLETED)
        if pre in done and pre.exception() is not None and not dec.done():
            exc = pre.exception()
            log.warning("%s", exc)
            dec.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dec
            if isinstance(exc, UpstreamError):
                return _json_error(exc.status, str(exc), "prefill_failed")
            return _json_error(502, f"prefill: {_reason(exc)}", "prefill_failed")
        out = await dec
        if not pre.done():
            pre.add_done_callback(_retrieve)  # the prefill's answer itself is not needed
        else:
            _retrieve(pre)
        return out

    async def _prefill(self, path: str, body: dict[str, Any], traceparent: str = "",
                       prefill: str | None = None, sent: dict[str, Any] | None = None
                       ) -> Any:
        """Run the prefill step; its ``kv_transfer_params``, or UpstreamError."""
        url = (prefill or self.prefill.pick()) + path
        assert self.session is not None
        try:
            async with self.session.post(url, json=sent or prefill_request(body, traceparent),
                                         headers=_trace_headers(traceparent),
                                         timeout=self._timeout(
                                             self.cfg.prefill_timeout_s)) as resp:
                text = await resp.text()
        except TimeoutError as exc:
            raise UpstreamError(504, f"prefill {url}: no answer within prefill_timeout_s="
                                     f"{self.cfg.prefill_timeout_s}") from exc
        except ClientError as exc:
            raise UpstreamError(502, f"prefill {url}: {_reason(exc)}") from exc
        if resp.status != 200:
            raise UpstreamError(resp.status if 400 <= resp.status < 500 else 502,
                                f"prefill {url} answered {resp.status}: {_upstream_message(text)}")
        try:
            params = json.loads(text).get("kv_transfer_params")
        except (ValueError, AttributeError) as exc:
            raise UpstreamError(502, f"prefill {url}: answer is not a JSON object") from exc
        if not params:
            raise UpstreamError(502, f"prefill {url} answered without kv_transfer_params: is "
                                     "it running with the kvd connector (--kv-transfer-config)?")
        return params

    async def _decode(self, request: web.Request, body: dict[str, Any], traceparent: str = ""
                      ) -> web.StreamResponse:
        """Run the decode step, passing its answer (streamed or not) through as it comes."""
        url = self.decode.pick() + request.path
        assert self.session is not None
        timeout = ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                sock_read=self.cfg.decode_read_timeout_s)
        out: web.StreamResponse | None = None
        try:
            async with self.session.post(url, json=body, headers=_trace_headers(traceparent),
                                         timeout=timeout) as resp:
                out = web.StreamResponse(status=resp.status, headers={
                    k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (ClientError, TimeoutError) as exc:
            message = f"decode {url}: {_reason(exc)}"
            log.warning("%s", message)
            if out is None or not out.prepared:
                return _json_error(502, message, "decode_failed")
            return out  # already streaming: the client sees the stream end early

    def _timeout(self, total_s: float) -> ClientTimeout:
        return ClientTimeout(total=total_s, connect=self.cfg.connect_timeout_s)


def _trace_headers(traceparent: str) -> dict[str, str] | None:
    """The W3C header an engine reads its trace context from (vLLM, with its tracing on)."""
    return {"traceparent": traceparent} if traceparent else None


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Take a finished task's outcome, so that a failure nobody awaits is not logged as
    lost (the decode answered already)."""
    if not task.cancelled() and task.exception() is not None:
        log.info("prefill after its decode answered: %s", task.exception())


def _json_error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(error_body(message, kind), status=status)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _upstream_message(text: str) -> str:
    """The ``error.message`` of an OpenAI error body, else the text (cut short)."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:300]


def run_router(cfg: RouterConfig, host: str, port: int) -> None:
    """Serve until interrupted (SIGINT/SIGTERM)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    log.info("kvd router on http://%s:%d: prefill %s, decode %s", host, port,
             ", ".join(cfg.prefill_urls), ", ".join(cfg.decode_urls))
    web.run_app(Router(cfg).app(), host=host, port=port, print=None)

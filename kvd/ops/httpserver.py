"""The metrics and health HTTP server: ``/metrics``, ``/livez``, ``/readyz``.

It runs in its own daemon thread on the stdlib ThreadingHTTPServer rather than
on the daemon's asyncio loop, so a scrape or a kubelet probe is answered even
while the loop is busy or stuck: ``/livez`` must fail only when the process
itself is gone, never because a peer is slow. ``/readyz`` calls the daemon's
``ready()`` callback, which must be cheap and thread-safe (read a few flags).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

log = logging.getLogger("kvd.http")

ReadyFn = Callable[[], "tuple[bool, str]"]


class HttpServerHandle:
    """A running server: ``port`` is the bound port (useful with port 0)."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host: str = server.server_address[0]
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the port; safe to call twice."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.server_close()


def _handler(registry: CollectorRegistry, ready: ReadyFn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvd"
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and "application/openmetrics-text" in self.headers.get(
                    "Accept", ""):  # OpenMetrics: the histograms' exemplars (trace ids) too
                self._send(200, openmetrics.generate_latest(registry),
                           openmetrics.CONTENT_TYPE_LATEST)
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/livez":
                self._send(200, b"ok\n")
            elif path == "/readyz":
                try:
                    ok, reason = ready()
                except Exception as exc:  # a broken callback means "not ready", not a 500
                    ok, reason = False, f"readiness check raised {type(exc).__name__}: {exc}"
                text = reason or ("ready" if ok else "not ready")
                self._send(200 if ok else 503, text.encode() + b"\n")
            else:
                self._send(404, b"not found; try /metrics, /livez or /readyz\n")

        def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
            self.do_GET()

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            # Probes hit every few seconds; one stderr line each would drown real logs.
            log.debug("http %s", format % args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # SO_REUSEADDR: a daemon restarted right after a crash must re-bind at once, even
    # while a probe's or a scrape's connection to the old process sits in TIME_WAIT
    # (kubelet probes every few seconds, so otherwise every crash costs up to a minute).
    # On Linux this never lets two processes listen on one port: a second bind while
    # the first still listens fails with EADDRINUSE (that is SO_REUSEPORT, left off).
    allow_reuse_address = True
    allow_reuse_port = False

    def handle_error(self, request: object, client_address: object) -> None:
        # A client hanging up mid-response is routine for scrapers; keep it off stderr.
        log.debug("http client %s error", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def start_http_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    ready: ReadyFn,
) -> HttpServerHandle:
    """Bind ``host:port`` (0 picks a free port) and serve in a daemon thread.

    Binding happens before this returns, so a port conflict raises OSError here,
    at start, rather than later in a background thread.
    """
    bind_host = host.strip("[]")
    server_cls = _Server6 if ":" in bind_host else _Server
    server = server_cls((bind_host, port), _handler(registry, ready))
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.2},
        name="kvd-http",
        daemon=True,
    )
    thread.start()
    return HttpServerHandle(server, thread)

"""The /metrics endpoint: a small threaded HTTP server of its own, so a scrape never waits on the
gateway's event loop (nor the event loop on a scrape).

* **TLS** when the fronts have it (``--ssl-certfile``; ``tls.server_ssl_context``, mTLS under
  ``--ssl-ca-certs`` included): HTTPS only, a plaintext request gets no answer. The handshake
  runs on the connection's own thread, so a client that stalls in it holds up no other scrape.
* **A bearer token** (``--metrics-token``, ``--metrics-token-file``): a scrape without
  ``authorization: Bearer <token>`` gets 401 and nothing else.

Connections that idle are dropped after ``CONNECTION_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.auth import log_refusal

logger = logging.getLogger(__name__)

CONNECTION_TIMEOUT_S = 30.0
# A scrape's headers -> None (it may have the metrics) or why not (Credentials.check_metrics).
CheckScrape = Callable[[Iterable[tuple[str, Any]]], ApiError | None]


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # a connection that stalls frees its thread

    def log_message(self, format: str, *args: Any) -> None:
        """No access log (scrapes come every few seconds)."""


class _ThreadedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(CONNECTION_TIMEOUT_S)
        tls = self.ssl_context.wrap_socket(request, server_side=True)  # the handshake
        try:
            super().finish_request(tls, client_address)
        finally:
            self.shutdown_request(tls)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed handshake (plaintext to the TLS port, an unknown client certificate) or a
        client gone: one DEBUG line, not a traceback on stderr."""
        logger.debug("/metrics: connection from %s failed", client_address, exc_info=True)


def _guarded(app: Callable[..., Any], check: CheckScrape) -> Callable[..., Any]:
    """``app`` behind ``check``: a refused scrape gets 401 and the reason."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        error = check([("authorization", environ.get("HTTP_AUTHORIZATION", ""))])
        if error is None:
            return app(environ, start_response)
        log_refusal(f"/metrics from {environ.get('REMOTE_ADDR', '?')}", error)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")],
        )
        return [f"401 Unauthorized: {error.message}\n".encode()]

    return guarded


class MetricsServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        ssl_context: ssl.SSLContext | None = None,
        check: CheckScrape | None = None,
    ) -> None:
        app = make_wsgi_app(registry)
        self._app = _guarded(app, check) if check is not None else app
        self._ssl_context = ssl_context
        self._server: _ThreadedServer | None = None
        self.scheme = "https" if ssl_context is not None else "http"

    def start(self, host: str, port: int) -> int:
        """Bind and serve on a daemon thread; returns the bound port."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)

        class Server(_ThreadedServer):
            address_family = family[0][0]
            ssl_context = self._ssl_context

        self._server = make_server(host, port, self._app, Server, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

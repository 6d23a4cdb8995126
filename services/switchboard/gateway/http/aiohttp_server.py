"""The gateway's HTTP server: aiohttp in the gateway's own event loop, next to grpc.aio.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI's
shapes, ``routes.py``), vLLM's ``POST /v1/embeddings``, ``/tokenize``, ``/detokenize``, ``GET
/version`` and ``/metrics`` (``vllm_routes.py``), ``GET /health`` (200 while the process
serves) and ``GET /ready`` (200 while the gRPC readiness service is SERVING: an engine core
READY and not stopping).
Handlers are cancelled when their client disconnects, so a dropped request is ABORTed at once.
With API keys (``gateway/auth.py``) every route but /health, /ready and /metrics needs
``Authorization: Bearer <key>`` (else 401 with an OpenAI error body); /metrics needs the
metrics token when one is set. With ``--ssl-certfile`` it serves HTTPS (``tls.py``; mTLS under
``--ssl-ca-certs``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from switchboard.common.tls import server_ssl_context, tls_enabled
from switchboard.config import GatewayRoleConfig
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.auth import Credentials, log_refusal
from switchboard.gateway.http import lora_routes
from switchboard.gateway.http.openai_errors import error_response, json_response
from switchboard.gateway.http.routes import OpenAIRoutes, internal_error
from switchboard.gateway.http.vllm_routes import METRICS_PATH, VllmRoutes
from switchboard.gateway.pipeline.generate_call import GenerateCalls
from switchboard.gateway.state import GatewayState

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_port(config: GatewayRoleConfig) -> int | None:
    """This gateway's HTTP port: ``--http-port`` + client_index when the gateways of one
    machine share it (as ``observer.metrics_port``), the port itself for a gateway alone."""
    port = config.gateway.http_port
    if port is None:
        return None
    alone = bool(config.handshake_address)
    return port if alone or port == 0 else port + config.client_index


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Nothing escapes as an HTML page: an unexpected error is a 500 with an OpenAI body."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        body = {
            "error": {
                "message": error.reason,
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        return json_response(body, error.status)
    except ApiError as error:  # the routes answer their own; this is a backstop
        return error_response(error)
    except Exception:
        logger.exception("HTTP %s %s failed", request.method, request.path)
        return internal_error("internal error (the gateway's log has the traceback)")


# Probes carry no key; /metrics asks for the metrics token instead (vllm_routes.py).
# The LoRA routes ask for the admin token themselves (http/lora_routes.py).
_OPEN_PATHS = frozenset({"/health", "/ready", METRICS_PATH, *lora_routes.PATHS})


def _api_keys(credentials: Credentials) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS:
            error = credentials.check_data_plane(request.headers.items())
            if error is not None:
                log_refusal(f"HTTP {request.method} {request.path!r} from {request.remote}", error)
                response = error_response(error)
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await handler(request)

    return check


class HttpServer:
    def __init__(
        self,
        state: GatewayState,
        calls: GenerateCalls,
        is_ready: Callable[[], bool],
        credentials: Credentials | None = None,
    ) -> None:
        self._state = state
        self._is_ready = is_ready
        self._stopping = False
        routes = OpenAIRoutes(state, calls)
        middlewares: list[Middleware] = [_openai_errors]
        if credentials is not None and credentials.keys_required:
            middlewares.append(_api_keys(credentials))
        app = web.Application(
            middlewares=middlewares, client_max_size=state.config.gateway.max_message_bytes
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/v1/models", routes.models)
        app.router.add_post("/v1/completions", routes.completions)
        app.router.add_post("/v1/chat/completions", routes.chat_completions)
        VllmRoutes(state, credentials).add_to(app.router)
        lora_routes.LoraRoutes(state, credentials).add_to(app.router)
        self._runner: web.AppRunner | None = None
        self._app = app
        self.port: int | None = None

    async def start(self, shutdown_timeout_s: float) -> int | None:
        """Bind and serve; return the bound port (None: the HTTP API is off)."""
        port = http_port(self._state.config)
        if port is None:
            return None
        host = self._state.config.gateway.host
        runner = web.AppRunner(
            self._app,
            handler_cancellation=True,  # a disconnect cancels the handler: ABORT
            access_log=None,
            shutdown_timeout=shutdown_timeout_s,
        )
        await runner.setup()
        gateway = self._state.config.gateway
        ssl_context = server_ssl_context(gateway) if tls_enabled(gateway) else None
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        shown = f"[{host}]" if ":" in host else host
        scheme = "https" if ssl_context is not None else "http"
        logger.info("HTTP (OpenAI-compatible) on %s://%s:%d", scheme, shown, self.port)
        return self.port

    async def stop(self) -> None:
        """/ready answers 503 at once; in-flight requests get the shutdown timeout."""
        self._stopping = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        if self._is_ready() and not self._stopping:
            return json_response({"status": "ready"})
        return json_response({"status": "not ready"}, 503)

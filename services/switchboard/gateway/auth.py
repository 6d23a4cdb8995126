"""Who may call the gateway: API keys on the data plane, a separate token for AdminService.

* Data plane (``switchboard.v1.GenerationService``, ``ModelService``,
  ``vllm.grpc.engine.VllmEngine``; HTTP ``/v1/*``): with API keys configured (``--api-key``,
  ``--api-key-file``) a call must carry ``authorization: Bearer <key>`` (gRPC metadata, or
  the HTTP header) with one of them; otherwise it ends with UNAUTHENTICATED (HTTP 401, an
  OpenAI error body) before its request is parsed.
* ``switchboard.v1.AdminService`` (and ``vllm.grpc.engine.VllmEngine``'s FlushCache,
  StartProfile, StopProfile; its other methods are data plane): with ``--admin-token`` only
  that token opens it (API keys do not); without one it is as open as the data plane is
  without keys (and the gateway warns).
* gRPC health and reflection, HTTP ``/health`` and ``/ready`` stay open: probes carry no key.
* ``/metrics`` (its own port): with a metrics token (``--metrics-token``,
  ``--metrics-token-file``) only that token opens it (401 otherwise); without one it is open.

Keys are compared with ``hmac.compare_digest`` against every key (no early exit on a match).
A wrong key or token is logged at WARNING (rate-limited per cause, ``log_limits``), a missing
one at DEBUG.
A call's *identity* is a short sha256 prefix of its key (never the key itself): the Abort RPC
reaches only the requests made with the same key (``GenerateCalls.abort``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from switchboard.common.log_limits import WarningLimit
from switchboard.config import ADMIN_TOKEN_ENV, API_KEYS_ENV, METRICS_TOKEN_ENV, GatewayConfig
from switchboard.gateway.api_errors import ApiError

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)

AUTHORIZATION = "authorization"
_BEARER = "bearer "
ADMIN_SERVICE_PREFIX = "/switchboard.v1.AdminService/"
# vLLM's engine service mixes both planes: these of its methods act on the engines, as
# AdminService's do, and take the admin token.
ADMIN_METHODS = frozenset(
    f"/vllm.grpc.engine.VllmEngine/{name}" for name in ("FlushCache", "StartProfile", "StopProfile")
)
# Services open without a key: probes and service discovery.
API_KEY_REASON = "INVALID_API_KEY"  # OpenAI's error code (lower case) in the HTTP body
ADMIN_REASON = "INVALID_ADMIN_TOKEN"
METRICS_REASON = "INVALID_METRICS_TOKEN"
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def parse_keys(text: str) -> list[str]:
    """One key per line; blank lines and surrounding whitespace ignored."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def identity_of(key: str) -> str:
    """What the gateway remembers of a key: the first 16 hex digits of its sha256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry, else None."""
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION:
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if value[: len(_BEARER)].lower() == _BEARER:
            return value[len(_BEARER) :].strip()
        return None
    return None


@dataclasses.dataclass(frozen=True)
class Credentials:
    """The secrets one gateway checks (loaded once at start; no hot reload)."""

    api_keys: tuple[str, ...] = ()
    admin_token: str = ""
    metrics_token: str = ""

    @classmethod
    def load(cls, gateway: GatewayConfig, environ: Mapping[str, str] | None = None) -> Credentials:
        """From ``$SWITCHBOARD_API_KEYS``, ``gateway.api_key_file``,
        ``$SWITCHBOARD_ADMIN_TOKEN``, and ``gateway.metrics_token_file`` or else
        ``$SWITCHBOARD_METRICS_TOKEN``; ValueError on a key or token file with none in it."""
        env = os.environ if environ is None else environ
        keys = parse_keys(env.get(API_KEYS_ENV, ""))
        if gateway.api_key_file:
            from_file = parse_keys(Path(gateway.api_key_file).read_text())
            if not from_file:
                raise ValueError(f"--api-key-file {gateway.api_key_file}: no key in it")
            keys += from_file
        metrics_token = env.get(METRICS_TOKEN_ENV, "").strip()
        if gateway.metrics_token_file:
            metrics_token = Path(gateway.metrics_token_file).read_text().strip()
            if not metrics_token or "\n" in metrics_token:
                raise ValueError(
                    f"--metrics-token-file {gateway.metrics_token_file}: want one token in it"
                )
        return cls(tuple(dict.fromkeys(keys)), env.get(ADMIN_TOKEN_ENV, "").strip(), metrics_token)

    @property
    def keys_required(self) -> bool:
        return bool(self.api_keys)

    def key_matches(self, token: str | None) -> bool:
        if token is None:
            return False
        given = token.encode()
        matched = False
        for key in self.api_keys:  # every key compared: the time says nothing of which
            matched |= hmac.compare_digest(given, key.encode())
        return matched

    def admin_matches(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.admin_token.encode())

    def identity(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """The identity of an admitted call's key; None when keys are off (every call alike)."""
        if not self.keys_required:
            return None
        token = bearer_token(metadata)
        return identity_of(token) if token is not None else None

    def check_data_plane(self, metadata: Iterable[tuple[str, Any]] | None) -> ApiError | None:
        """None when the call may go on, else the error to end it with."""
        if not self.keys_required:
            return None
        token = bearer_token(metadata)
        if token is None:
            return unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        if not self.key_matches(token):
            return unauthenticated("invalid API key")
        return None

    def check_admin(self, metadata: Iterable[tuple[str, Any]] | None) -> ApiError | None:
        if self.admin_token:
            token = bearer_token(metadata)
            if token is None:
                return unauthenticated(
                    "missing admin token: send 'authorization: Bearer <token>'", ADMIN_REASON
                )
            if not self.admin_matches(token):
                return unauthenticated("invalid admin token", ADMIN_REASON)
            return None
        return self.check_data_plane(metadata)

    def check_metrics(self, metadata: Iterable[tuple[str, Any]] | None) -> ApiError | None:
        """A scrape of /metrics: None when it may have them (no token set, or the token)."""
        if not self.metrics_token:
            return None
        token = bearer_token(metadata)
        if token is None:
            return unauthenticated(
                "missing metrics token: send 'authorization: Bearer <token>'", METRICS_REASON
            )
        if not hmac.compare_digest(token.encode(), self.metrics_token.encode()):
            return unauthenticated("invalid metrics token", METRICS_REASON)
        return None

    def check_method(
        self, method: str, metadata: Iterable[tuple[str, Any]] | None
    ) -> ApiError | None:
        if method.startswith(OPEN_SERVICE_PREFIXES):
            return None
        if method.startswith(ADMIN_SERVICE_PREFIX) or method in ADMIN_METHODS:
            return self.check_admin(metadata)
        return self.check_data_plane(metadata)


def unauthenticated(message: str, reason: str = API_KEY_REASON) -> ApiError:
    return ApiError(grpc.StatusCode.UNAUTHENTICATED, message, reason=reason)


def log_refusal(what: str, error: ApiError) -> None:
    """A call refused for its key: someone holding a wrong key or token is worth a WARNING
    (its message is the cause: a few fixed words); a call without one, a DEBUG line."""
    if error.message.startswith("missing"):
        logger.debug("refused %s: %s", what, error.message)
    else:
        limited.warning(error.message, "refused %s: %s", what, error.message)


def _refusal(error: ApiError, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with ``error`` and never
    parses the request (no deserializer: the bytes are dropped unread)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await error.abort(context)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await error.abort(context)
        yield  # pragma: no cover  (abort raises)

    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, None, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, None, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, None, serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, None, serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """The gRPC front's gate (first of the server's interceptors)."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # UNIMPLEMENTED, as without keys
        method = handler_call_details.method
        error = self._credentials.check_method(method, handler_call_details.invocation_metadata)
        if error is None:
            return handler
        log_refusal(method, error)
        return _refusal(error, handler)

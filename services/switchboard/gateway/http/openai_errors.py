"""OpenAI-shaped error bodies ``{"error": {"message", "type", "param", "code"}}``.

An ``ApiError`` keeps its gRPC code; here it becomes the HTTP status OpenAI clients expect
(400 bad parameter, 404 unknown model, 503 no engine, 500 internal), and its field (a path in
the ``GenerateRequest``, e.g. ``sampling.temperature``) becomes the OpenAI parameter name.
"""

from __future__ import annotations

import json
import math
import re

import grpc
from aiohttp import web

from switchboard.gateway.api_errors import ApiError

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}
_FIELD_PREFIX = re.compile(r"^(sampling|stopping|output)\.")
_FIELD_INDEX = re.compile(r"\[\d+\]$")


def http_status(code: grpc.StatusCode) -> int:
    return _HTTP_STATUS.get(code, 500)


def openai_param(field: str, renames: dict[str, str] | None = None) -> str | None:
    """``sampling.temperature`` -> ``temperature``; ``renames`` maps what differs per route
    (``text`` -> ``prompt``, ``logprobs`` -> ``top_logprobs`` ...)."""
    if not field:
        return None
    name = _FIELD_INDEX.sub("", _FIELD_PREFIX.sub("", field))
    return (renames or {}).get(name, name)


def error_body(error: ApiError, renames: dict[str, str] | None = None) -> dict:
    status = http_status(error.code)
    return {
        "error": {
            "message": error.message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": openai_param(error.field, renames),
            "code": error.reason.lower() if error.reason else None,
        }
    }


def dumps(obj: object) -> str:
    """Compact JSON; a -inf logprob (allowed by the engine) becomes -9999.0, as in vLLM."""
    return json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False)


def _finite(obj: object) -> object:
    if isinstance(obj, float) and not math.isfinite(obj):
        return -9999.0 if obj < 0 else 9999.0
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None):
    return web.Response(
        text=dumps(obj), status=status, content_type="application/json", headers=headers
    )


def error_response(error: ApiError, renames: dict[str, str] | None = None) -> web.Response:
    headers = None
    if error.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    return json_response(error_body(error, renames), http_status(error.code), headers)

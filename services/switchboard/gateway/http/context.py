"""The ``CallContext`` of an HTTP request: what the shared call path reads of its front."""

from __future__ import annotations

import grpc
from aiohttp import web


class HttpCallContext:
    """Headers stand in for gRPC metadata (``traceparent`` included); the call has no status
    of its own before it ends and no deadline."""

    def __init__(self, request: web.Request) -> None:
        self._request = request

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((key.lower(), value) for key, value in self._request.headers.items())

    def peer(self) -> str:
        return f"http:{self._request.remote or ''}"

    def code(self) -> grpc.StatusCode | None:
        return None

    def time_remaining(self) -> float | None:
        return None

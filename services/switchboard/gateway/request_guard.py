"""Malformed protobuf requests end with INVALID_ARGUMENT and one WARNING line (at most
``log_limits.DEFAULT_BURST`` a minute, then a count: a client cannot flood the log).

grpc.aio deserializes a request before any servicer code runs; when the bytes do not parse, it
logs the DecodeError's traceback at ERROR and answers UNKNOWN. This server interceptor gives
every unary-request method a deserializer that never raises (it hands a ``_Malformed`` marker
on) and a behaviour that answers the marker with INVALID_ARGUMENT, saying what did not parse.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from switchboard.common.log_limits import WarningLimit

logger = logging.getLogger(__name__)
limited = WarningLimit(logger)


class _Malformed:
    def __init__(self, error: Exception, size: int) -> None:
        self.error = error
        self.size = size


async def _reject(method: str, request: _Malformed, context: grpc.aio.ServicerContext) -> None:
    limited.warning(
        "malformed request",
        "malformed request to %s from %s (%d bytes): %s",
        method,
        context.peer(),
        request.size,
        request.error,
    )
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid protobuf message for {method}: {request.error}",
    )


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    assert parse is not None

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as error:  # DecodeError, or whatever a custom parser raises
            return _Malformed(error, len(raw))

    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _reject(method, request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, deserialize, handler.response_serializer
        )

    stream = handler.unary_stream
    assert stream is not None

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await _reject(method, request, context)
        result = stream(request, context)
        if inspect.isasyncgen(result):
            async for response in result:
                yield response
        else:  # a coroutine that writes with context.write
            await result

    return grpc.unary_stream_rpc_method_handler(
        unary_stream, deserialize, handler.response_serializer
    )


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._cache: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        guarded = self._cache.get(method)
        if guarded is None:  # one wrapper per method, not per call
            guarded = self._cache[method] = _guarded(handler, method)
        return guarded

"""API errors: a terminal gRPC status with ``google.rpc.Status`` details, never an in-band string.

Details travel in the ``grpc-status-details-bin`` trailer (the standard place, read by
grpcio-status, grpc-go's ``status.FromError`` and grpcurl): an ``ErrorInfo`` with a machine
reason, a ``BadRequest`` naming the offending field, and ``RetryInfo`` when retrying helps.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "switchboard"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ApiError(Exception):
    """Ends the current RPC with ``code``; raised anywhere below a servicer."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str = "",
        field: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or code.name
        self.field = field
        self.retry_after_s = retry_after_s

    def status_proto(self) -> status_pb2.Status:
        details = [error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN)]
        if self.field:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.message
            )
            details.append(error_details_pb2.BadRequest(field_violations=[violation]))
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(self.retry_after_s * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        packed = []
        for detail in details:
            any_detail = any_pb2.Any()
            any_detail.Pack(detail)
            packed.append(any_detail)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return ((STATUS_DETAILS_KEY, self.status_proto().SerializeToString()),)

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        """End the RPC with this error (raises, as ``context.abort`` does)."""
        await context.abort(self.code, self.message, trailing_metadata=self.trailing_metadata())


_Method = TypeVar("_Method", bound=Callable[..., Any])


def maps_api_errors(method: _Method) -> _Method:
    """Decorates a servicer method ``(self, request, context)``, unary or streaming: an
    ``ApiError`` raised inside ends the RPC with its status, message and details. The one place
    an API error becomes a gRPC status; anything else propagates to grpc (UNKNOWN)."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streaming(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                async for response in method(self, request, context):
                    yield response
            except ApiError as error:
                await error.abort(context)

        return streaming  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except ApiError as error:
            await error.abort(context)

    return unary  # type: ignore[return-value]


def invalid_argument(field: str, message: str, reason: str = "") -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field, reason=reason)


def not_supported(field: str, what: str) -> ApiError:
    return invalid_argument(field, f"{field}: {what} is not supported yet", reason="NOT_SUPPORTED")


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        grpc.StatusCode.NOT_FOUND,
        f"model {model!r} is not served here (served: {served!r})",
        reason="MODEL_NOT_FOUND",
        field="model",
    )


def unavailable(message: str, retry_after_s: float | None = 1.0) -> ApiError:
    return ApiError(
        grpc.StatusCode.UNAVAILABLE,
        message,
        reason="ENGINE_UNAVAILABLE",
        retry_after_s=retry_after_s,
    )


def status_details(error: grpc.RpcError) -> status_pb2.Status | None:
    """Client side: the ``google.rpc.Status`` in an error's trailers, if any."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None

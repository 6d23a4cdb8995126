"""The gateway's utility calls to engine cores: one future per call id, resolved by the engine's
reply.

A reply travels on the engine's PUSH, tagged with the call id; a call whose engine dies (or
whose gateway shuts down) fails with UNAVAILABLE instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc

from switchboard.gateway.api_errors import ApiError, unavailable
from switchboard.gateway.engines.types import EngineHandle, SendRequest
from switchboard.wire.engine_msgs import RequestType, UtilityCall, UtilityOutput

logger = logging.getLogger(__name__)


class UtilityCalls:
    def __init__(self, send: SendRequest, client_index: int) -> None:
        self._send = send
        self._client_index = client_index
        self._calls: dict[int, tuple[EngineHandle, asyncio.Future]] = {}
        self._call_ids = itertools.count(1)

    async def call(
        self, engine: EngineHandle, method: str, args: list[Any], timeout_s: float
    ) -> Any:
        """Call an engine-core utility method; raise ApiError if the engine reports failure."""
        if not engine.alive:
            raise unavailable(f"engine {engine.engine_id} is not ready")
        call_id = next(self._call_ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (engine, future)
        try:
            call = UtilityCall(self._client_index, call_id, method, args)
            if not self._send(engine, RequestType.UTILITY, call):
                raise unavailable(f"engine {engine.engine_id} is unreachable")
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise ApiError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"engine {engine.engine_id} did not answer {method} within {timeout_s}s",
            ) from None
        finally:
            self._calls.pop(call_id, None)

    def resolve(self, result: UtilityOutput) -> None:
        entry = self._calls.get(result.call_id)
        if entry is None or entry[1].done():
            logger.warning("dropped a utility result for unknown call %d", result.call_id)
            return
        engine, future = entry
        if result.failure_message is not None:
            future.set_exception(
                ApiError(
                    grpc.StatusCode.INTERNAL,
                    f"engine {engine.engine_id}: {result.failure_message}",
                    reason="UTILITY_FAILED",
                )
            )
        else:
            future.set_result(result.result)

    def fail(self, error: ApiError, engine: EngineHandle | None = None) -> None:
        """Fail the calls to ``engine`` (every call when None)."""
        for call_id, (call_engine, future) in list(self._calls.items()):
            if engine is None or call_engine is engine:
                if not future.done():
                    future.set_exception(error)
                self._calls.pop(call_id, None)

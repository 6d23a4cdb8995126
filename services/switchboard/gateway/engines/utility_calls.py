"""The gateway's utility calls in flight: one future per call id, resolved by the engine's reply.

A reply travels on the engine's PUSH, tagged with the call id; a call whose engine dies (or
whose gateway shuts down) fails with UNAVAILABLE instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from switchboard.gateway.engines.types import EngineHandle
from switchboard.gateway.errors import ApiError
from switchboard.wire.engine_msgs import UtilityOutput

logger = logging.getLogger(__name__)


class PendingUtilityCalls:
    def __init__(self) -> None:
        self._calls: dict[int, tuple[EngineHandle, asyncio.Future]] = {}
        self._call_ids = itertools.count(1)

    def open(self, engine: EngineHandle) -> tuple[int, asyncio.Future]:
        call_id = next(self._call_ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (engine, future)
        return call_id, future

    def close(self, call_id: int) -> None:
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

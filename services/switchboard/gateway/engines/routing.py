"""A request's way to an engine core and back: ADD to the engine the pool picks, ABORT, and the
hand-off of each engine step's outputs to the requests' channels."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import grpc
import msgspec

from switchboard.gateway.api_errors import ApiError, unavailable
from switchboard.gateway.engines.membership import EngineMembership
from switchboard.gateway.engines.types import (
    EngineHandle,
    RequestAborted,
    RequestChannel,
    RequestFailed,
    SendRequest,
    StepOutput,
)
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
)

logger = logging.getLogger(__name__)


class RequestRouter:
    def __init__(self, membership: EngineMembership, send: SendRequest) -> None:
        self._membership = membership
        self._send = send
        self._requests: dict[str, RequestChannel] = {}  # in flight, by request id

    def is_live(self, request_id: str) -> bool:
        return request_id in self._requests

    def channel(self, request_id: str) -> RequestChannel | None:
        return self._requests.get(request_id)

    def channels(self) -> Iterable[RequestChannel]:
        return self._requests.values()

    def channels_on(self, engine: EngineHandle) -> list[RequestChannel]:
        return [c for c in self._requests.values() if c.engine is engine]

    # -- out -----------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> RequestChannel:
        """Send ADD to the engine ``engine_pool`` picks (or the pinned ``data_parallel_rank``);
        outputs arrive on the returned channel."""
        if request.request_id in self._requests:
            raise ApiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request.request_id!r} is already in flight",
                reason="DUPLICATE_REQUEST_ID",
                field="request_id",
            )
        engine = self._membership.choose(request.data_parallel_rank, request)
        channel = RequestChannel(request.request_id, engine, request)
        self._requests[request.request_id] = channel
        self.count_on(channel, engine)
        # A failed send marks the engine dead, which fails its requests over, this one too:
        # it is then sent to the next engine that takes it, as a stream cut off is (resume).
        self._send(engine, RequestType.ADD, request)
        return channel

    def abort(self, request_ids: list[str], reason: str = "aborted") -> list[str]:
        """Abort in-flight requests: ABORT to their engines, RequestAborted to their channels.
        Returns the ids that were in flight; unknown ids are ignored (aborting is idempotent)."""
        by_engine: dict[int, tuple[EngineHandle, list[str]]] = {}
        aborted = []
        for request_id in request_ids:
            channel = self.forget(request_id)
            if channel is None:
                continue
            aborted.append(request_id)
            channel.put(RequestAborted(reason))
            rank = channel.engine.ready.data_parallel_rank
            by_engine.setdefault(rank, (channel.engine, []))[1].append(request_id)
        for engine, ids in by_engine.values():
            if engine.alive:
                self._send(engine, RequestType.ABORT, ids)
        if aborted:
            logger.debug("aborted %d request(s) (%s): %s", len(aborted), reason, aborted)
        return aborted

    # -- bookkeeping ---------------------------------------------------------------------------

    @staticmethod
    def count_on(channel: RequestChannel, engine: EngineHandle) -> None:
        """``channel``'s request now runs on ``engine``: it counts in that engine's load, and
        waits for its first token there."""
        channel.engine = engine
        channel.counted = True
        channel.last_token_at = None
        channel.stalled = False
        engine.num_requests += 1
        engine.added_since_load += 1

    @staticmethod
    def uncount(channel: RequestChannel) -> None:
        """``channel``'s request no longer waits on its engine (finished, or cut off)."""
        if channel.counted:
            channel.engine.num_requests -= 1
            channel.counted = False

    def forget(self, request_id: str) -> RequestChannel | None:
        channel = self._requests.pop(request_id, None)
        if channel is not None:
            self.uncount(channel)
        return channel

    def fail_all(self, why: str) -> None:
        """End every request in flight with UNAVAILABLE (the gateway is shutting down)."""
        for channel in self._requests.values():
            channel.put(RequestFailed(unavailable(why)))
        self._requests.clear()

    # -- back ----------------------------------------------------------------------------------

    def deliver(self, engine: EngineHandle, outputs: EngineCoreOutputs) -> None:
        """Hand one step's outputs of ``engine`` to their requests' channels."""
        # Requests' first tokens are handed on before the other streams' next ones: each
        # stream's task runs in the order it is woken, so a new request's first token would
        # otherwise wait for every other stream of the step to go through this loop and gRPC.
        later: list[tuple[RequestChannel, EngineCoreOutput]] = []
        now = time.monotonic()
        for output in outputs.outputs:
            channel = self._requests.get(output.request_id)
            if channel is None or channel.engine is not engine:
                continue  # finished, aborted or failed here already, or resumed elsewhere
            if channel.delivered:
                later.append((channel, output))
            else:
                self._deliver(channel, output, outputs.timestamp_ns, now)
        for channel, output in later:
            self._deliver(channel, output, outputs.timestamp_ns, now)

    def _deliver(
        self, channel: RequestChannel, output: EngineCoreOutput, timestamp_ns: int, now: float
    ) -> None:
        if channel.resumes and output.num_cached_tokens:  # a hit on its own output
            output = msgspec.structs.replace(output, num_cached_tokens=0)
        if output.new_token_ids:
            channel.last_token_at = now
            channel.stalled = False
        channel.delivered += output.new_token_ids
        channel.put(StepOutput(output, timestamp_ns, channel.engine))
        if output.finish_reason is not None:
            self.forget(output.request_id)

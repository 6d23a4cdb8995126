"""What the gateway's engine client hands out: engine handles, and per-request channels of events.

A request's channel yields, in order, ``StepOutput``s (one per engine step that touched the
request) and ends with a finished ``StepOutput``, a ``RequestFailed`` (the engine died or the
gateway is shutting down: UNAVAILABLE) or a ``RequestAborted`` (Abort RPC, stop string).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.engines.engine_clock import EngineClock
from switchboard.gateway.engines.prefix_table import PrefixTable
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineLoad,
    EngineReady,
    RequestType,
    SchedulerStats,
)


class EngineState(enum.Enum):
    READY = "ready"
    DEAD = "dead"


@dataclasses.dataclass
class EngineHandle:
    """One engine core as the gateway sees it."""

    identity: bytes
    ready: EngineReady
    state: EngineState = EngineState.READY
    last_seen: float = 0.0  # time.monotonic() of its last message
    scheduler_stats: SchedulerStats | None = None
    num_requests: int = 0  # this gateway's requests in flight on it
    load: EngineLoad | None = None  # the coordinator's latest report of it (DP > 1)
    added_since_load: int = 0  # requests this gateway sent it since that report
    # The engine named this gateway the one that exports its engine-level metrics (its latest
    # stats said so): exactly one gateway per engine, whatever the topology.
    exports_engine_stats: bool = False

    @property
    def engine_id(self) -> str:
        return self.ready.engine_id

    @property
    def alive(self) -> bool:
        return self.state is EngineState.READY

    @property
    def stalled(self) -> bool:
        """A worker of it has not answered a step within the step timeout (its latest stats)."""
        stats = self.scheduler_stats
        return stats is not None and stats.stalled_worker_rank >= 0

    @property
    def routable(self) -> bool:
        """New requests may go to it: READY and not stalled."""
        return self.alive and not self.stalled

    @functools.cached_property
    def prefix_table(self) -> PrefixTable:
        """What its prefix cache holds, as block hashes (prefix_routing.py); a restarted
        engine (a new handle) starts empty, as its cache does."""
        return PrefixTable(self.ready.num_gpu_blocks)

    @functools.cached_property
    def clock(self) -> EngineClock:
        """This engine's clock placed on the gateway's wall clock: READY's anchor, kept within
        what the gateway observes (engine_clock.py)."""
        ready = self.ready
        return EngineClock(ready.engine_id, ready.wall_clock_ns, ready.monotonic_ns)

    def wall_clock_ns(self, engine_monotonic_ns: int) -> int:
        """Place an engine monotonic timestamp on this gateway's wall clock."""
        return self.clock.to_wall_ns(engine_monotonic_ns)


@dataclasses.dataclass(slots=True)
class StepOutput:
    output: EngineCoreOutput
    timestamp_ns: int  # the engine's monotonic clock when the step's outputs were made
    engine: EngineHandle | None = None  # the engine that made it (a resumed stream has two)


@dataclasses.dataclass(slots=True)
class RequestFailed:
    error: ApiError


@dataclasses.dataclass(slots=True)
class RequestAborted:
    reason: str


RequestEvent = StepOutput | RequestFailed | RequestAborted

# Sends one request frame to an engine; False (and the engine is marked dead) if it cannot go out.
SendRequest = Callable[[EngineHandle, RequestType, Any], bool]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _ends_request(event: RequestEvent) -> bool:
    """A finished step, a failure or an abort: nothing comes after it."""
    return not isinstance(event, StepOutput) or event.output.finish_reason is not None


class RequestChannel:
    """The outputs of one request, in order, ending with a finish, a failure or an abort.

    It outlives its engine when the request is resumed (``engines/resume.py``): ``engine`` is
    then the engine it runs on now, and its outputs keep coming on the same channel."""

    def __init__(
        self, request_id: str, engine: EngineHandle, request: EngineCoreRequest | None = None
    ) -> None:
        self.request_id = request_id
        self.engine = engine
        self.request = request  # as first sent (a resume re-sends it, extended)
        self.delivered: list[int] = []  # output token ids handed out so far
        self.counted = True  # in engine.num_requests (not while it waits to resume)
        self.resumes = 0
        # time.monotonic() of the latest output with tokens from its engine (None: none yet
        # from this engine), and whether it has been counted as paused since (stream_stalls.py).
        self.last_token_at: float | None = None
        self.stalled = False
        self._events: collections.deque[RequestEvent] = collections.deque()
        self._arrived = asyncio.Event()
        self._end_waiter: asyncio.Future[None] | None = None  # end_arrival's, while it waits

    def put(self, event: RequestEvent) -> None:
        self._events.append(event)
        self._arrived.set()
        if _ends_request(event) and self._end_waiter is not None:
            _wake(self._end_waiter)

    async def get(self) -> RequestEvent:
        while not self._events:
            self._arrived.clear()
            await self._arrived.wait()
        return self._events.popleft()

    def end_queued(self) -> bool:
        """Whether the event that ends the request is already here (a finished step, a
        failure, an abort): nothing comes after it."""
        return bool(self._events) and _ends_request(self._events[-1])

    async def end_arrival(self, deadline: float | None = None) -> None:
        """Until the event that ends the request is queued (those before it are left
        queued), or until the event loop's clock reaches ``deadline`` if that comes first: a
        consumer that holds its steps back is not woken by each of them. Either way it returns,
        raising nothing: a timeout around the wait cancelled the task at the deadline and raised
        through it, at every paced message (the gateway's CPU a token 123 -> 117 us without)."""
        if self.end_queued():
            return
        loop = asyncio.get_running_loop()
        waiter = self._end_waiter = loop.create_future()
        timer = None if deadline is None else loop.call_at(deadline, _wake, waiter)
        try:
            await waiter
        finally:
            self._end_waiter = None
            if timer is not None:
                timer.cancel()

    def take_ready_step(self) -> StepOutput | None:
        """The next event if it is already here and is a step's output, without waiting: a
        consumer that fell behind takes the steps that queued up together."""
        if not self._events:
            return None
        event = self._events[0]
        if not isinstance(event, StepOutput):
            return None
        self._events.popleft()
        return event

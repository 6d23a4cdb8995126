"""The ``n`` sequences of one Generate call, and their responses merged into one stream.

``n`` > 1 fans out into ``n`` engine requests that share the prompt (ids ``<i>_<request_id>``,
as vLLM names its child requests; with a seed, sequence ``i`` uses ``seed + i``). Each has its
own ``GenerateStream``; the group merges their messages::

    DELTA / CUMULATIVE  each sequence's messages as they come (``outputs[0].index`` says which);
                        PromptInfo on the very first message only; Usage (summed) and the
                        call's RequestMetrics on the message that ends the last sequence
    FINAL_ONLY          one message once every sequence ended, outputs ordered by index

With ``n`` == 1 the child is the request itself and its messages pass through, the last one
given the RequestMetrics. Those come from the call's ``RequestTimeline``, the one record the
metrics and spans report from too (``observability/request_timeline.py``).
The engine computes the shared prompt once: the first child computes it, and a sibling whose
next prompt block is being computed in the same step waits that step for the prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.engines.types import (
    EngineHandle,
    RequestChannel,
    RequestEvent,
    StepOutput,
)
from switchboard.gateway.observability.request_timeline import RequestTimeline
from switchboard.gateway.pipeline.generate_stream import GenerateStream
from switchboard.wire.engine_msgs import EngineCoreRequest


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_requests(request: EngineCoreRequest, n: int) -> list[EngineCoreRequest]:
    """The engine requests of the ``n`` sequences (the request itself when ``n`` is 1)."""
    if n == 1:
        return [request]
    params = request.sampling_params
    children = []
    for i, child_id in enumerate(child_request_ids(request.request_id, n)):
        child_params = params
        if params is not None and params.seed is not None:
            child_params = msgspec.structs.replace(params, seed=params.seed + i)
        children.append(
            msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
        )
    return children


def submit_children(
    add_request: Callable[[EngineCoreRequest], RequestChannel],
    abort: Callable[[list[str], str], object],
    children: list[EngineCoreRequest],
) -> list[RequestChannel]:
    """ADD every child; if one cannot be added, abort those already sent and re-raise."""
    channels: list[RequestChannel] = []
    try:
        for child in children:
            channels.append(add_request(child))
    except BaseException:
        if channels:
            abort([c.request_id for c in channels], "a sibling sequence could not be added")
        raise
    return channels


class SequenceGroup:
    def __init__(
        self,
        streams: list[GenerateStream],
        channels: list[RequestChannel],
        timeline: RequestTimeline,
    ) -> None:
        self.streams = streams
        self.channels = channels
        self.timeline = timeline  # the call's; fed every event before ``handle`` sees it
        self.request_ids = [channel.request_id for channel in channels]
        self._kind = streams[0].plan.output_kind
        self._sent_first = False
        self._finals: dict[int, pb.GenerateResponse] = {}
        self._pending: dict[int, asyncio.Task] = {}

    @property
    def engine(self) -> EngineHandle:
        return self.channels[0].engine

    @property
    def finished(self) -> bool:
        return all(stream.finished for stream in self.streams)

    # -- events in ----------------------------------------------------------------------------

    async def next_event(self) -> tuple[int, RequestEvent]:
        """The next event of any unfinished sequence: (its index, the event)."""
        if len(self.channels) == 1:
            return 0, await self.channels[0].get()
        for i, channel in enumerate(self.channels):
            if not self.streams[i].finished and i not in self._pending:
                self._pending[i] = asyncio.ensure_future(channel.get())
        await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        index = min(i for i, task in self._pending.items() if task.done())
        return index, self._pending.pop(index).result()

    def ready_event(self) -> tuple[int, StepOutput] | None:
        """The next step output if it is already queued and the call has one sequence (its
        caller sends the steps that queued up as one message); None otherwise, without waiting."""
        if len(self.channels) != 1 or self.finished:
            return None
        step = self.channels[0].take_ready_step()
        return None if step is None else (0, step)

    def close(self) -> None:
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()

    # -- responses out ------------------------------------------------------------------------

    def handle(
        self, index: int, event: RequestEvent, hold: bool = False
    ) -> pb.GenerateResponse | None:
        """Feed one event of sequence ``index``; return the message to send, if any (``hold``:
        ``GenerateStream.handle``'s, for a call of one sequence)."""
        stream = self.streams[index]
        if stream.finished:
            return None  # e.g. the ABORT echo after a stop string ended it
        response = stream.handle(event, hold)
        if response is None:
            return None
        if len(self.streams) == 1:
            if stream.finished:
                response.metrics.CopyFrom(self._metrics())
            return response
        if stream.finished:  # kept whole: its usage is cleared below
            self._finals[index] = pb.GenerateResponse()
            self._finals[index].CopyFrom(response)
        if self._kind == pb.OUTPUT_KIND_FINAL_ONLY:
            return self._final_only() if self.finished else None
        if self._sent_first:
            response.ClearField("prompt_info")
        self._sent_first = True
        response.ClearField("usage")
        if self.finished:
            response.usage.CopyFrom(self.usage())
            response.metrics.CopyFrom(self._metrics())
        return response

    def _final_only(self) -> pb.GenerateResponse:
        finals = [self._finals[i] for i in range(len(self.streams))]
        response = pb.GenerateResponse(request_id=self.streams[0].plan.request_id)
        for final in finals:
            response.outputs.extend(final.outputs)
        response.prompt_info.CopyFrom(finals[0].prompt_info)
        response.usage.CopyFrom(self.usage())
        response.metrics.CopyFrom(self._metrics())
        return response

    def usage(self) -> pb.Usage:
        """The prompt once, the completion tokens of every sequence."""
        usages = [stream.usage() for stream in self.streams]
        return pb.Usage(
            prompt_tokens=usages[0].prompt_tokens,
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_prompt_tokens=max(u.cached_prompt_tokens for u in usages),
            spec_draft_tokens=sum(u.spec_draft_tokens for u in usages),
            spec_accepted_tokens=sum(u.spec_accepted_tokens for u in usages),
        )

    def _metrics(self) -> pb.RequestMetrics:
        """The call's RequestMetrics: its timeline closed now (the observer reports the same)."""
        engine = self.engine  # the engine that ran it last (a resumed stream had others)
        clock = self.timeline.clock or engine.clock  # the one its stamps are on
        times = self.timeline.close(clock.offset, time.time_ns())
        metrics = pb.RequestMetrics(
            num_preemptions=times.num_preemptions, engine_id=engine.engine_id
        )
        metrics.arrival_time.FromNanoseconds(self.timeline.arrival_ns)
        metrics.e2e_latency.FromNanoseconds(times.e2e_ns)
        for field, ns in (
            ("queue_time", times.queue_ns),
            ("prefill_time", times.prefill_ns),
            ("decode_time", times.decode_ns),
            ("time_to_first_token", times.ttft_ns),
        ):
            if ns is not None:
                getattr(metrics, field).FromNanoseconds(ns)
        return metrics

"""The ``n`` sequences of one Generate call, and their responses merged into one stream.

``n`` > 1 fans out into ``n`` engine requests that share the prompt (ids ``<i>_<request_id>``,
as vLLM names its child requests; with a seed, sequence ``i`` uses ``seed + i``). Each has its
own ``GenerateStream``; the group merges their messages::

    DELTA / CUMULATIVE  each sequence's messages as they come (``outputs[0].index`` says which);
                        PromptInfo on the very first message only; Usage (summed) and the
                        merged RequestMetrics on the message that ends the last sequence
    FINAL_ONLY          one message once every sequence ended, outputs ordered by index

With ``n`` == 1 the child is the request itself and every message passes through unchanged.
The engine computes the shared prompt once: the first child computes it, and a sibling whose
next prompt block is being computed in the same step waits that step for the prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.engines.types import EngineHandle, RequestChannel, RequestEvent
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
    def __init__(self, streams: list[GenerateStream], channels: list[RequestChannel]) -> None:
        self.streams = streams
        self.channels = channels
        self.request_ids = [channel.request_id for channel in channels]
        self._kind = streams[0].plan.output_kind
        self._sent_first = False
        self._finals: dict[int, pb.GenerateResponse] = {}
        self._stop_aborted: set[int] = set()
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

    def close(self) -> None:
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()

    def take_stopped_request_ids(self) -> list[str]:
        """Sequences a stop string ended since the last call: the engine needs an ABORT."""
        stopped = []
        for i, stream in enumerate(self.streams):
            if stream.stopped_by_string and i not in self._stop_aborted:
                self._stop_aborted.add(i)
                stopped.append(self.request_ids[i])
        return stopped

    # -- responses out ------------------------------------------------------------------------

    def handle(self, index: int, event: RequestEvent) -> pb.GenerateResponse | None:
        """Feed one event of sequence ``index``; return the message to send, if any."""
        stream = self.streams[index]
        if stream.finished:
            return None  # e.g. the ABORT echo after a stop string ended it
        response = stream.handle(event)
        if len(self.streams) == 1 or response is None:
            return response
        if stream.finished:  # kept whole: its usage and metrics are cleared below
            self._finals[index] = pb.GenerateResponse()
            self._finals[index].CopyFrom(response)
        if self._kind == pb.OUTPUT_KIND_FINAL_ONLY:
            return self._final_only() if self.finished else None
        if self._sent_first:
            response.ClearField("prompt_info")
        self._sent_first = True
        response.ClearField("usage")
        response.ClearField("metrics")
        if self.finished:
            response.usage.CopyFrom(self.usage())
            response.metrics.CopyFrom(self._merged_metrics())
        return response

    def _final_only(self) -> pb.GenerateResponse:
        finals = [self._finals[i] for i in range(len(self.streams))]
        response = pb.GenerateResponse(request_id=self.streams[0].plan.request_id)
        for final in finals:
            response.outputs.extend(final.outputs)
        response.prompt_info.CopyFrom(finals[0].prompt_info)
        response.usage.CopyFrom(self.usage())
        response.metrics.CopyFrom(self._merged_metrics())
        return response

    def usage(self) -> pb.Usage:
        """The prompt once, the completion tokens of every sequence."""
        usages = [stream.usage() for stream in self.streams]
        return pb.Usage(
            prompt_tokens=usages[0].prompt_tokens,
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_prompt_tokens=max(u.cached_prompt_tokens for u in usages),
        )

    def _merged_metrics(self) -> pb.RequestMetrics:
        """The request's view: its first sequence to be queued, scheduled and to give a token;
        its last sequence to end; the preemptions of all."""
        metrics = [self._finals[i].metrics for i in sorted(self._finals)]
        merged = pb.RequestMetrics()
        merged.CopyFrom(metrics[0])
        for field in ("queue_time", "time_to_first_token", "prefill_time"):
            present = [m for m in metrics if m.HasField(field)]
            if present:
                getattr(merged, field).CopyFrom(
                    min((getattr(m, field) for m in present), key=lambda d: d.ToNanoseconds())
                )
        for field in ("decode_time", "e2e_latency"):
            present = [m for m in metrics if m.HasField(field)]
            if present:
                getattr(merged, field).CopyFrom(
                    max((getattr(m, field) for m in present), key=lambda d: d.ToNanoseconds())
                )
        merged.num_preemptions = sum(m.num_preemptions for m in metrics)
        return merged

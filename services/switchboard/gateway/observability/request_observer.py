"""One Generate call's observer: records the call's timeline from its events and, when it
ends, reports it to the tracer and the metrics (``request_report.py``) and counts its tokens
for the stats log line. Made by ``Observability.begin``."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.engines.engine_clock import EngineClock
from switchboard.gateway.engines.types import (
    EngineHandle,
    RequestAborted,
    RequestEvent,
    RequestFailed,
    StepOutput,
)
from switchboard.gateway.observability.request_report import (
    report_metrics,
    report_spans,
    request_attributes,
)
from switchboard.gateway.observability.request_timeline import RequestTimeline
from switchboard.wire.engine_msgs import EngineCoreRequest, EventType, FinishReason

if TYPE_CHECKING:
    from switchboard.gateway.observability.observer import Observability
    from switchboard.gateway.observability.tracing import RequestSpans
    from switchboard.gateway.pipeline.validation import GeneratePlan

logger = logging.getLogger(__name__)

_PB_FINISH_WORDS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_REPETITION: "repetition",
}
_CANCELLED = (asyncio.CancelledError, GeneratorExit)


class RequestObserver:
    """One Generate call: records its timeline and reports it to the tracer and the metrics."""

    def __init__(
        self,
        observability: Observability,
        request_id: str,
        arrival_time: float,
        context: grpc.aio.ServicerContext,
    ) -> None:
        self._obs = observability
        self._context = context
        self.timeline = RequestTimeline(request_id, int(arrival_time * 1e9))
        self._clock: EngineClock | None = None  # the first engine's: the timeline's stamps
        self._engine_label = ""  # the engine that ran it last
        self._first_token_label = ""  # the engine that gave its first token
        self._engines: dict[str, EngineHandle] = {}  # the engine of each sequence now
        self._prompt_text: str | None = None
        self._ended = False
        self._ended_by: FinishReason | None = None  # an abort or failure the channel reported
        self._spans: RequestSpans | None = None
        observability.counts.requests_in_flight += 1
        if observability.tracer is not None:
            metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
            self._spans = observability.tracer.start_request(
                request_id,
                observability.model_name,
                self.timeline.arrival_ns,
                metadata,
                context.peer() or "",
            )

    def submitting(self, plan: GeneratePlan, request: EngineCoreRequest) -> None:
        """The request is tokenized and checked; its ADD goes out next. With tracing on, the
        engine gets the text_completion span's context instead of the caller's."""
        timeline = self.timeline
        timeline.submitted_ns = time.time_ns()
        timeline.num_prompt_tokens = len(request.prompt_token_ids)
        if self._spans is not None:
            self._spans.set_request_attributes(request_attributes(plan, request))
            request.trace_context = self._spans.engine_trace_context()
            if self._obs.trace_content:
                timeline.output_token_ids = []
                self._prompt_text = plan.prompt_text
                if self._prompt_text is None:
                    self._prompt_text = self._obs.text(request.prompt_token_ids)

    def submitted(self, engines: dict[str, EngineHandle]) -> None:
        """The ADDs went out: the engine of each sequence (engine request id)."""
        self._engines = dict(engines)
        first = next(iter(engines.values()))
        self._clock = self.timeline.clock = first.clock
        self._engine_label = _label(first)
        for engine in engines.values():
            self.timeline.served_by(_served_by(engine))

    def _engine_of(self, step: StepOutput) -> EngineHandle | None:
        """The engine that made ``step``; a sequence that comes from another engine than
        before was resumed there."""
        engine, sequence = step.engine, step.output.request_id
        if engine is None:
            return self._engines.get(sequence)
        before = self._engines.get(sequence)
        if before is not engine:
            self._engines[sequence] = engine
            if before is None:
                self.timeline.served_by(_served_by(engine))
            else:
                self.timeline.resumed(sequence, _served_by(before), _served_by(engine))
        self._engine_label = _label(engine)
        return engine

    def on_event(self, event: RequestEvent) -> None:
        timeline = self.timeline
        if isinstance(event, RequestAborted):
            self._ended_by = self._ended_by or FinishReason.ABORT
            return
        if isinstance(event, RequestFailed):
            self._ended_by = self._ended_by or FinishReason.ERROR
            return
        assert isinstance(event, StepOutput)
        engine = self._engine_of(event)
        clock = engine.clock if engine is not None else self._clock
        shift_ns = 0
        if clock is not None:
            clock.not_after(event.timestamp_ns, time.time_ns())  # it was stamped before now
            if timeline.submitted_ns is not None:
                for queued in event.output.events or ():
                    if queued.type == EventType.QUEUED:  # queued after the ADD went out
                        clock.not_before(queued.timestamp_ns, timeline.submitted_ns)
            if self._clock is not None and clock is not self._clock:
                shift_ns = clock.offset - self._clock.offset  # onto the first engine's clock
        first = timeline.first_token_ns is None
        previous_token_ns = timeline.sequence_last_token_ns.get(event.output.request_id)
        num_new = timeline.record_output(event.output, event.timestamp_ns, shift_ns)
        if not num_new:
            return
        counts, metrics = self._obs.counts, self._obs.metrics
        counts.generation_tokens += num_new
        if first:
            counts.prompt_tokens += timeline.num_prompt_tokens
            self._first_token_label = self._engine_label
        if metrics is None:
            return
        requests = metrics.requests
        inter_token_s = None
        if previous_token_ns is not None:  # this sequence's previous output
            inter_token_s = (event.timestamp_ns + shift_ns - previous_token_ns) / 1e9
        requests.tokens(self._engine_label, num_new, inter_token_s)

    def end(self, streams: Any) -> None:
        """The call is over (normally, by an error, or cancelled): report it. Call it from the
        servicer's ``finally`` block; it reads the exception in flight, if any. ``streams``:
        the call's ``GenerateStream``, or the group of its ``n`` sequences (anything with
        ``streams``), whose finish reasons win (a stop string is the gateway's word)."""
        if self._ended:
            return
        self._ended = True
        timeline = self.timeline
        obs = self._obs
        obs.counts.requests_in_flight -= 1
        code = self._status_code()
        reasons = self._finish_words(streams, code)
        clock = self._clock
        # Already closed when the last response went out (its RequestMetrics): the same times.
        times = timeline.close(clock.offset if clock is not None else None, time.time_ns())
        try:
            if obs.metrics is not None:
                report_metrics(
                    obs.metrics,
                    timeline,
                    times,
                    code,
                    reasons,
                    self._first_token_label,
                    self._engine_label,
                )
            if self._spans is not None:
                content = None
                if obs.trace_content and timeline.output_token_ids is not None:
                    content = (self._prompt_text or "", obs.text(timeline.output_token_ids))
                report_spans(self._spans, timeline, times, code, reasons, obs.model_name, content)
        except Exception:  # observability must never break a request
            logger.exception("request %s: reporting traces/metrics failed", timeline.request_id)

    # ---- internals ---------------------------------------------------------------------------

    def _status_code(self) -> grpc.StatusCode:
        error = sys.exc_info()[1]
        code = self._context.code()
        if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
            return code
        if isinstance(error, ApiError):  # on its way to ``maps_api_errors``
            return error.code
        if isinstance(error, _CANCELLED):
            remaining = self._context.time_remaining()
            if remaining is not None and remaining <= 0:
                return grpc.StatusCode.DEADLINE_EXCEEDED
            return grpc.StatusCode.CANCELLED
        if error is not None:
            return grpc.StatusCode.UNKNOWN
        return grpc.StatusCode.OK

    def _finish_words(self, streams: Any, code: grpc.StatusCode) -> list[str]:
        """One word per sequence: ``stop``, ``length``, ``abort``, ``error``, ``repetition``."""
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ["abort"]
        if code != grpc.StatusCode.OK:
            return ["error"]
        group = getattr(streams, "streams", None)
        finished = group if group is not None else [streams] if streams is not None else []
        if finished and all(s.finished for s in finished):  # the gateway's word (stop strings)
            return [_PB_FINISH_WORDS.get(s.finish_reason, "stop") for s in finished]
        engine_words = [str(reason) for reason in self.timeline.finish_reasons.values()]
        return engine_words or [str(self._ended_by) if self._ended_by is not None else "stop"]


def _label(engine: EngineHandle) -> str:
    return str(engine.ready.data_parallel_rank)


def _served_by(engine: EngineHandle) -> tuple[int, str]:
    return engine.ready.data_parallel_rank, engine.engine_id

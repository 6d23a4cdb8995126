"""Traces, metrics and the stats log line of one gateway, behind one small per-request API.

The request path calls, per Generate::

    observer = state.observability.begin(request_id, arrival_time, context)
    observer.submitting(plan, engine_request)   # tokenized and checked; ADD about to go out
    observer.submitted(engines)                 # the engine each sequence went to
    observer.on_event(event)                    # every event of the request's channel
    observer.end(stream)                        # in ``finally``: however the call ended

Each piece costs nothing when off: no tracer without an OTLP endpoint (OpenTelemetry is not even
imported), no Prometheus registry without ``--metrics-port`` (served over TLS when the fronts
have it, behind the metrics token when there is one). What is always kept is the
request's timeline (a few integers per engine step) and two token counters for the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.common.tls import server_ssl_context, tls_enabled
from switchboard.config import GatewayRoleConfig
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.auth import Credentials
from switchboard.gateway.engines.engine_clock import EngineClock
from switchboard.gateway.engines.types import (
    EngineHandle,
    RequestAborted,
    RequestEvent,
    RequestFailed,
    StepOutput,
)
from switchboard.gateway.observability.request_timeline import RequestTimeline, RequestTimes
from switchboard.gateway.observability.stats_log import StatsLogger, TokenCounts
from switchboard.gateway.observability.trace_phases import request_phases
from switchboard.gateway.observability.tracing_config import tracing_settings
from switchboard.wire.engine_msgs import EngineCoreRequest, EventType, FinishReason

if TYPE_CHECKING:
    from switchboard.gateway.engines.engine_client import EngineClient
    from switchboard.gateway.observability.metrics import GatewayMetrics
    from switchboard.gateway.observability.tracing import GatewayTracer, RequestSpans
    from switchboard.gateway.pipeline.validation import GeneratePlan
    from switchboard.gateway.text import Tokenizer

logger = logging.getLogger(__name__)

_PB_FINISH_WORDS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
    pb.FINISH_REASON_REPETITION: "repetition",
}
_CANCELLED = (asyncio.CancelledError, GeneratorExit)


def metrics_port(config: GatewayRoleConfig) -> int | None:
    """This gateway's /metrics port: ``--metrics-port`` + client_index when the gateways of one
    machine share it (one-machine serve), the port itself for a gateway that runs alone
    (engines join it over TCP: its pod has the port to itself)."""
    port = config.gateway.metrics_port
    if port is None:
        return None
    alone = bool(config.handshake_address)
    return port if alone or port == 0 else port + config.client_index


class Observability:
    """Owned by the gateway server; ``start``/``stop`` with it."""

    def __init__(
        self,
        config: GatewayRoleConfig,
        tokenizer: Tokenizer,
        engines: EngineClient,
        credentials: Credentials | None = None,
    ) -> None:
        self.config = config
        self._credentials = credentials or Credentials()
        self.model_name = config.model.name
        self._tokenizer = tokenizer
        self._engines = engines
        self.counts = TokenCounts()
        self.tracer: GatewayTracer | None = None
        settings = tracing_settings(config.gateway)
        if settings is not None:
            from switchboard.gateway.observability.tracing import GatewayTracer

            self.tracer = GatewayTracer(
                settings, config.client_index, config.gateway.host, config.gateway.port
            )
        self.trace_content = settings is not None and settings.trace_content
        self.metrics: GatewayMetrics | None = None
        if config.gateway.metrics_port is not None:
            from switchboard.gateway.observability.metrics import GatewayMetrics

            self.metrics = GatewayMetrics(
                self.model_name,
                config.model.max_model_len or 1 << 20,
                lambda: list(engines.engines.values()),
                config.model.lora.max_loras if config.model.lora.enable_lora else 0,
            )
        self._stats_task: asyncio.Task | None = None

    def request_resumed(self, cut_off_on: EngineHandle, engine: EngineHandle) -> None:
        """A stream cut off by the death of ``cut_off_on`` was re-submitted to ``engine``."""
        if self.metrics is not None:
            requests = self.metrics.requests
            labels = requests.labels(str(engine.ready.data_parallel_rank))
            from_engine = str(cut_off_on.ready.data_parallel_rank)
            requests.resumed.labels(*labels, from_engine).inc()

    def stream_stalled(self, engine: EngineHandle) -> None:
        """A stream on ``engine`` got no token for longer than ``--stall-warn-s``."""
        if self.metrics is not None:
            requests = self.metrics.requests
            labels = requests.labels(str(engine.ready.data_parallel_rank))
            requests.stalls.labels(*labels).inc()

    def start(self) -> None:
        """Serve /metrics and start the stats log line (inside the event loop)."""
        port = metrics_port(self.config)
        if self.metrics is not None and port is not None:
            gateway, credentials = self.config.gateway, self._credentials
            self.metrics.serve(
                gateway.host,
                port,
                server_ssl_context(gateway) if tls_enabled(gateway) else None,
                credentials.check_metrics if credentials.metrics_token else None,
            )
        interval = self.config.gateway.log_stats_interval_s
        if interval > 0:
            stats = StatsLogger(
                self.config.client_index,
                interval,
                self.counts,
                lambda: list(self._engines.engines.values()),
            )
            self._stats_task = asyncio.get_running_loop().create_task(stats.run(), name="stats-log")

    async def stop(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
            self._stats_task = None
        if self.metrics is not None:
            self.metrics.stop()
        if self.tracer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.shutdown)

    def begin(
        self, request_id: str, arrival_time: float, context: grpc.aio.ServicerContext
    ) -> RequestObserver:
        return RequestObserver(self, request_id, arrival_time, context)

    def text(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, False)


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
            self._spans.set_request_attributes(_request_attributes(plan, request))
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
                self._report_metrics(code, reasons, times)
            if self._spans is not None:
                self._report_spans(code, reasons, times)
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

    def _report_metrics(
        self, code: grpc.StatusCode, reasons: list[str], times: RequestTimes
    ) -> None:
        metrics = self._obs.metrics
        assert metrics is not None
        t = self.timeline
        e2e_s = times.e2e_ns / 1e9
        phases = {
            "queue": _seconds(times.queue_ns),
            "prefill": _seconds(times.prefill_ns),
            "decode": _seconds(times.decode_ns),
            "inference": _seconds(times.inference_ns),
        }
        if times.ttft_ns is not None and self._first_token_label:
            # Observed when the call closes, not at its first token: from the same record (and
            # clock placement) as the client's RequestMetrics and the span. The engine that
            # gave the first token; a resumed call's later engines count its later tokens.
            metrics.requests.first_token(
                self._first_token_label,
                times.ttft_ns / 1e9,
                t.num_prompt_tokens,
                t.num_cached_tokens,
            )
        if t.submitted_ns is not None and self._engine_label:
            metrics.requests.finished(
                self._engine_label,
                reasons,
                e2e_s,
                phases,
                t.num_prompt_tokens,
                t.num_output_tokens,
            )
        elif "abort" in reasons:
            # Cancelled before an engine had it (during tokenization, or before the first
            # await): still an aborted request, counted with no engine (engine="").
            requests = metrics.requests
            for reason in reasons:
                requests.request_success.labels(*requests.labels(self._engine_label), reason).inc()
        metrics.requests.gen_ai(
            "" if code == grpc.StatusCode.OK else code.name,
            e2e_s,
            _seconds(times.ttft_ns),
            _seconds(times.tpot_ns),
            t.num_prompt_tokens,
            t.num_output_tokens,
        )

    def _report_spans(self, code: grpc.StatusCode, reasons: list[str], times: RequestTimes) -> None:
        spans = self._spans
        assert spans is not None
        t = self.timeline
        assert t.end_ns is not None
        ended_normally = code == grpc.StatusCode.OK and not {"abort", "error"} & set(reasons)
        phases = request_phases(t, t.to_wall_ns, ended_normally)
        attributes: dict[str, Any] = {
            "gen_ai.response.model": self._obs.model_name,
            "gen_ai.response.finish_reasons": reasons,
        }
        if t.submitted_ns is not None:
            attributes["gen_ai.usage.input_tokens"] = t.num_prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = t.num_output_tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = t.num_cached_tokens
        if times.ttft_ns is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = times.ttft_ns / 1e9
        if t.engine_index is not None:
            attributes["switchboard.engine.index"] = t.engine_index
            attributes["switchboard.engine.id"] = t.engine_id
            attributes["switchboard.request.num_preemptions"] = times.num_preemptions
            attributes["switchboard.request.engine_ids"] = [engine for _, engine in t.engines]
            attributes["switchboard.request.num_resumes"] = len(t.resumes)
        if t.num_draft_tokens:
            attributes.update(spec_decode_attributes(t.num_draft_tokens, t.num_accepted_tokens))
        content = None
        if self._obs.trace_content and t.output_token_ids is not None:
            content = (self._prompt_text or "", self._obs.text(t.output_token_ids))
        spans.finish(t.end_ns, code, attributes, phases, content)


def _label(engine: EngineHandle) -> str:
    return str(engine.ready.data_parallel_rank)


def _served_by(engine: EngineHandle) -> tuple[int, str]:
    return engine.ready.data_parallel_rank, engine.engine_id


def spec_decode_attributes(num_draft_tokens: int, num_accepted_tokens: int) -> dict[str, Any]:
    """Speculative decoding's record of one request, on its span."""
    return {
        "switchboard.request.spec_decode.num_draft_tokens": num_draft_tokens,
        "switchboard.request.spec_decode.num_accepted_tokens": num_accepted_tokens,
        "switchboard.request.spec_decode.acceptance_rate": num_accepted_tokens / num_draft_tokens,
    }


def _seconds(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e9


def _request_attributes(plan: GeneratePlan, request: EngineCoreRequest) -> dict[str, Any]:
    """gen_ai.request.* from what the engine was asked to do (defaults already applied)."""
    attributes: dict[str, Any] = {}
    sampling = request.sampling_params
    if sampling is not None:
        attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
        attributes["gen_ai.request.temperature"] = float(sampling.temperature)
        attributes["gen_ai.request.top_p"] = float(sampling.top_p)
        if sampling.top_k > 0:
            attributes["gen_ai.request.top_k"] = float(sampling.top_k)
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
    stop = getattr(plan, "stop", None)
    if stop:
        attributes["gen_ai.request.stop_sequences"] = list(stop)
    if request.priority:
        attributes["switchboard.request.priority"] = request.priority
    lora_name = getattr(plan, "lora_name", "")
    if lora_name:  # the adapter it runs with (gen_ai.request.model stays the name asked for)
        attributes["switchboard.request.lora_adapter"] = lora_name
    return attributes

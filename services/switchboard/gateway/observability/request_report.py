"""What one finished gateway request reports: its metrics (``GatewayMetrics``) and its span's
closing attributes and phases (``RequestSpans``), from its timeline and the times closing it
gave (:class:`RequestTimes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from switchboard.gateway.observability.request_timeline import RequestTimeline, RequestTimes
from switchboard.gateway.observability.trace_phases import request_phases
from switchboard.wire.engine_msgs import EngineCoreRequest

if TYPE_CHECKING:
    from switchboard.gateway.observability.metrics import GatewayMetrics
    from switchboard.gateway.observability.tracing import RequestSpans
    from switchboard.gateway.pipeline.validation import GeneratePlan


def report_metrics(
    metrics: GatewayMetrics,
    timeline: RequestTimeline,
    times: RequestTimes,
    code: grpc.StatusCode,
    reasons: list[str],
    first_token_engine: str,
    engine: str,
) -> None:
    """``first_token_engine``: the engine label that gave the first token; ``engine``: the one
    that ran the request last ("" for none)."""
    t = timeline
    e2e_s = times.e2e_ns / 1e9
    phases = {
        "queue": _seconds(times.queue_ns),
        "prefill": _seconds(times.prefill_ns),
        "decode": _seconds(times.decode_ns),
        "inference": _seconds(times.inference_ns),
    }
    if times.ttft_ns is not None and first_token_engine:
        # Observed when the call closes, not at its first token: from the same record (and
        # clock placement) as the client's RequestMetrics and the span. The engine that
        # gave the first token; a resumed call's later engines count its later tokens.
        metrics.requests.first_token(
            first_token_engine,
            times.ttft_ns / 1e9,
            t.num_prompt_tokens,
            t.num_cached_tokens,
        )
    if t.submitted_ns is not None and engine:
        metrics.requests.finished(
            engine,
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
            requests.request_success.labels(*requests.labels(engine), reason).inc()
    metrics.requests.gen_ai(
        "" if code == grpc.StatusCode.OK else code.name,
        e2e_s,
        _seconds(times.ttft_ns),
        _seconds(times.tpot_ns),
        t.num_prompt_tokens,
        t.num_output_tokens,
    )


def report_spans(
    spans: RequestSpans,
    timeline: RequestTimeline,
    times: RequestTimes,
    code: grpc.StatusCode,
    reasons: list[str],
    model_name: str,
    content: tuple[str, str] | None,
) -> None:
    """Close the request's spans; ``content``: (prompt, output) text when traces carry it."""
    t = timeline
    assert t.end_ns is not None
    ended_normally = code == grpc.StatusCode.OK and not {"abort", "error"} & set(reasons)
    phases = request_phases(t, t.to_wall_ns, ended_normally)
    attributes: dict[str, Any] = {
        "gen_ai.response.model": model_name,
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
    spans.finish(t.end_ns, code, attributes, phases, content)


def spec_decode_attributes(num_draft_tokens: int, num_accepted_tokens: int) -> dict[str, Any]:
    """Speculative decoding's record of one request, on its span."""
    return {
        "switchboard.request.spec_decode.num_draft_tokens": num_draft_tokens,
        "switchboard.request.spec_decode.num_accepted_tokens": num_accepted_tokens,
        "switchboard.request.spec_decode.acceptance_rate": num_accepted_tokens / num_draft_tokens,
    }


def _seconds(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e9


def request_attributes(plan: GeneratePlan, request: EngineCoreRequest) -> dict[str, Any]:
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

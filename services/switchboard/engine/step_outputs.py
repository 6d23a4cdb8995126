"""What one step did to one request, as its wire-1 output.

A generating request gets the step's sampled tokens up to the first stop (``stop_check``), with
their logprobs; a pooling request whose prompt is done gets its vector. Either function marks
the request FINISHED when the step ended it; the scheduler then frees what it held.
"""

from __future__ import annotations

import logging
from typing import Any

from switchboard.engine.request import Request, RequestStatus
from switchboard.engine.stop_check import check_stop
from switchboard.wire.engine_msgs import EngineCoreOutput, FinishReason, TokenLogprobs

logger = logging.getLogger(__name__)


def sampled_output(
    request: Request,
    new_token_ids: list[int],
    max_model_len: int,
    new_logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs] | None = None,
) -> EngineCoreOutput:
    """Append the sampled tokens up to the first that stops the request; their output."""
    first_output = request.num_output_tokens == 0
    stop = None
    appended = new_token_ids
    grammar = request.grammar
    for i, token_id in enumerate(new_token_ids):
        request.append_output_token(token_id)
        stop = check_stop(request, max_model_len)
        if grammar is not None:
            stop = _grammar_stop(grammar, token_id, stop)
        if stop is not None:
            appended = new_token_ids[: i + 1]
            break
    finish_reason, stop_reason = stop if stop is not None else (None, None)
    output = EngineCoreOutput(
        request.request_id,
        appended,
        None,
        finish_reason,
        stop_reason,
        request.take_events(),
        request.num_cached_tokens if first_output else 0,
        request.num_preemptions,
    )
    if new_logprobs:
        output.new_logprobs = new_logprobs[: len(appended)]
    if prompt_logprobs is not None:
        output.prompt_logprobs = prompt_logprobs
    if finish_reason is not None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = finish_reason
        request.stop_reason = stop_reason
    return output


def _grammar_stop(
    grammar: Any, token_id: int, stop: tuple[FinishReason, int | str | None] | None
) -> tuple[FinishReason, int | str | None] | None:
    """Advance a constrained request's matcher with its accepted token. A complete output ends
    with STOP (even on its max_tokens-th token: the output is whole); a token the grammar
    rejects (the worker's mask should make that impossible) ends it with ERROR; otherwise the
    token-level stop stands, so an output cut by max_tokens is LENGTH, never STOP (a stop token
    of the request's own stop_token_ids still stops it, as in vLLM)."""
    if not grammar.accept(token_id):
        logger.error("structured output: token %d rejected (%s)", token_id, grammar.error_message())
        return FinishReason.ERROR, grammar.error_message()
    if grammar.is_terminated:
        return FinishReason.STOP, stop[1] if stop is not None else None
    return stop


def pooled_output(request: Request, vector: list[float] | None) -> EngineCoreOutput:
    """End a pooling request with its vector (STOP), or ERROR if the worker sent none."""
    reason = FinishReason.STOP if vector is not None else FinishReason.ERROR
    if vector is None:
        logger.error("pooling request %s: the worker sent no vector", request.request_id)
    output = EngineCoreOutput(
        request.request_id,
        finish_reason=reason,
        events=request.take_events(),
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_preemptions=request.num_preemptions,
        pooled_output=vector,
    )
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    return output

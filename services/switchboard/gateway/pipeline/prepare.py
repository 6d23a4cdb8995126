"""GenerateRequest -> the EngineCoreRequest to ADD: every check, in one pass around tokenization.

``prepare_generate`` reads top to bottom; each check comes before the work it guards:

    1. the model generates; the prompt's bytes can fit, the pinned rank exists (request_bounds.py)
    2. every field that needs no tokens: ``validation.plan_generate`` (the wire's rules on single
       fields, the API's own, structured output's)
    3. the bad words' text can fit their token bound (bad_words.py); an engine can serve it
    4. the prompt, tokenized in the thread pool, then ``validation.resolve_prompt``: truncation,
       vocabulary, room for output
    5. thread pool: the grammar compiles (constraint_check.py); the bad words' tokens
    6. ``validation.build_engine_request``: max_tokens / min_tokens in the room the prompt leaves

A step that fails raises ``ApiError`` (mostly INVALID_ARGUMENT naming the field); nothing is
queued or sent to an engine before the whole pass is through (``generate_call.py`` does that).
"""

from __future__ import annotations

import dataclasses

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError
from switchboard.gateway.chat.prompt import chat_prompt_token_ids
from switchboard.gateway.pipeline.bad_words import check_bad_word_bytes, tokenize_bad_words
from switchboard.gateway.pipeline.constraint_check import check_structured_output_plan
from switchboard.gateway.pipeline.request_bounds import (
    check_data_parallel_rank,
    check_text_bytes,
    prompt_bytes,
)
from switchboard.gateway.pipeline.validation import (
    GeneratePlan,
    build_engine_request,
    plan_generate,
    resolve_prompt,
)
from switchboard.gateway.state import GatewayState
from switchboard.wire.engine_msgs import EngineCoreRequest


@dataclasses.dataclass(frozen=True)
class PreparedGenerate:
    """A request that passed every check: its plan, its prompt's ids, what the engine gets."""

    plan: GeneratePlan
    prompt_token_ids: list[int]
    engine_request: EngineCoreRequest


async def prepare_generate(
    request: pb.GenerateRequest,
    request_id: str,
    state: GatewayState,
    *,
    arrival_time: float,
    trace_context: dict[str, str] | None,
) -> PreparedGenerate:
    facts = state.facts
    if not facts.tasks.can_generate:
        raise ApiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {facts.name!r} is an encoder: it serves Embed only",
            reason="TASK_NOT_SUPPORTED",
        )
    _check_work(request, state)
    await state.adapter_lookup.learn(request)  # an adapter loaded through another gateway
    plan = plan_generate(request, request_id, facts, state.chat_template)
    if plan.bad_words and state.longest_token_bytes:
        check_bad_word_bytes(plan.bad_words, state.longest_token_bytes)
    if not state.engines.routable_engines and not state.engines.restart_expected:
        state.engines.check_routable()  # UNAVAILABLE, saying why (e.g. a stalled worker)
    prompt_token_ids = resolve_prompt(plan, await _tokenize_prompt(plan, state), facts)
    if plan.structured_output is not None:  # a bad grammar is refused before ADD
        await state.in_pool(check_structured_output_plan, plan.structured_output)
    bad_words_token_ids = None
    if plan.bad_words:
        bad_words_token_ids = await state.in_pool(
            tokenize_bad_words, state.tokenizer, plan.bad_words, facts.vocab_size
        )
    engine_request = build_engine_request(
        plan,
        prompt_token_ids,
        facts,
        client_index=state.config.client_index,
        arrival_time=arrival_time,
        trace_context=trace_context,
        bad_words_token_ids=bad_words_token_ids,
    )
    return PreparedGenerate(plan, prompt_token_ids, engine_request)


def _check_work(request: pb.GenerateRequest, state: GatewayState) -> None:
    """What bounds the work before any of it: the prompt's bytes, the pinned rank."""
    if state.longest_token_bytes:
        check_text_bytes(
            "messages" if request.messages else "text",
            prompt_bytes(request),
            state.max_prompt_bytes,
        )
    if request.HasField("data_parallel_rank"):
        check_data_parallel_rank(
            request.data_parallel_rank, state.config.num_engines, state.engines.engines
        )


async def _tokenize_prompt(plan: GeneratePlan, state: GatewayState) -> list[int]:
    """The prompt's ids: the chat rendered by the template, the text, or the ids as given."""
    if plan.chat is not None and state.chat_template is not None:
        return await state.in_pool(
            chat_prompt_token_ids, state.chat_template, state.tokenizer, plan.chat
        )
    if plan.prompt_text is not None:
        return await state.in_pool(state.tokenizer.encode, plan.prompt_text)
    return plan.prompt_token_ids or []

"""GenerationService.Embed: texts or token ids in, one pooled vector per input out.

    EmbedRequest -> plan_embed (checks that need no tokens, on the event loop)
                 -> tokenize the texts (one call in the tokenizer pool, special tokens added)
                 -> resolve_inputs (truncate_prompt_tokens, lengths, vocabulary)
                 -> one engine request per input, ``<request_id>-<index>``, with PoolingParams
                 -> every input's ``pooled_output`` -> PoolingResult per input, in input order

The engine runs each input's prompt only (no sampling) and answers with the pooled vector.
Unset ``normalize`` and the pooling type come from the checkpoint (``model_tasks.py``: its
sentence-transformers files, else last-token pooling for decoders), normalized by default.
``dimensions`` keeps the first N values (Matryoshka) before normalizing. If the call fails or
is cancelled, the inputs still in flight are aborted on the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc

from switchboard.api.v1 import common_pb2
from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.engines.types import RequestAborted, RequestChannel, RequestFailed
from switchboard.gateway.errors import (
    ApiError,
    invalid_argument,
    maps_api_errors,
    not_supported,
    unavailable,
)
from switchboard.gateway.model_facts import ModelFacts
from switchboard.gateway.pipeline.request_bounds import (
    check_model_name,
    check_request_id,
    check_text_bytes,
)
from switchboard.gateway.pipeline.sampling_validation import check_token_ids
from switchboard.gateway.pipeline.validation import MAX_REQUEST_ID_CHARS, check_model
from switchboard.gateway.state import GatewayState
from switchboard.gateway.text import Tokenizer
from switchboard.wire.engine_msgs import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    PoolingParams,
)

logger = logging.getLogger(__name__)

_EMBED_TASKS = (common_pb2.MODEL_TASK_UNSPECIFIED, common_pb2.MODEL_TASK_EMBED)


@dataclasses.dataclass(frozen=True)
class EmbedPlan:
    """A checked EmbedRequest, waiting for its texts' token ids."""

    request_id: str
    inputs: list[str | list[int]]  # per input: its text, or its token ids
    pooling: PoolingParams
    truncate_prompt_tokens: int | None


def plan_embed(request: pb.EmbedRequest, request_id: str, facts: ModelFacts) -> EmbedPlan:
    check_model(request.model, facts)
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(
            "request_id", f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters"
        )
    if request.task not in _EMBED_TASKS:
        if request.task not in common_pb2.ModelTask.values():
            raise invalid_argument("task", f"task: unknown ModelTask value {request.task}")
        raise not_supported("task", common_pb2.ModelTask.Name(request.task))
    if not request.inputs:
        raise invalid_argument("inputs", "inputs must hold at least one input")
    inputs: list[str | list[int]] = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind is None:
            raise invalid_argument(f"inputs[{i}]", f"inputs[{i}] has neither text nor token_ids")
        inputs.append(item.text if kind == "text" else list(item.token_ids.ids))
    tasks = facts.tasks
    dimensions = request.dimensions if request.HasField("dimensions") else None
    if dimensions is not None and not 1 <= dimensions <= (tasks.hidden_size or dimensions):
        raise invalid_argument(
            "dimensions",
            f"dimensions must be in [1, {tasks.hidden_size}] (the model's embedding size), "
            f"got {dimensions}",
        )
    truncate = (
        request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None
    )
    if truncate is not None and truncate < 1:
        raise invalid_argument(
            "truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1, got {truncate}"
        )
    normalize = request.normalize if request.HasField("normalize") else tasks.normalize
    return EmbedPlan(
        request_id=request_id,
        inputs=inputs,
        pooling=PoolingParams(tasks.pooling_type, normalize, dimensions),
        truncate_prompt_tokens=truncate,
    )


def tokenize_inputs(tokenizer: Tokenizer, inputs: list[str | list[int]]) -> list[list[int]]:
    """Runs in the tokenizer pool: texts get the checkpoint's special tokens ([CLS]/[SEP] for
    BERT, BOS for Llama), token ids are taken as they are."""
    return [tokenizer.encode(x) if isinstance(x, str) else x for x in inputs]


def resolve_inputs(
    plan: EmbedPlan, token_ids: list[list[int]], facts: ModelFacts
) -> list[list[int]]:
    """Truncate and check every input's tokens; returns what the engine gets."""
    resolved = []
    for i, (given, ids) in enumerate(zip(plan.inputs, token_ids, strict=True)):
        field = f"inputs[{i}].text" if isinstance(given, str) else f"inputs[{i}].token_ids.ids"
        if plan.truncate_prompt_tokens is not None:
            ids = ids[-plan.truncate_prompt_tokens :]
        if not ids:
            raise invalid_argument(field, f"{field}: the input has no tokens")
        if len(ids) > facts.max_model_len:
            raise invalid_argument(
                field,
                f"{field}: the input has {len(ids)} tokens but max_model_len is "
                f"{facts.max_model_len} (set truncate_prompt_tokens to keep the last N)",
                reason="PROMPT_TOO_LONG",
            )
        if not isinstance(given, str):
            check_token_ids(field, ids, facts.vocab_size)
        resolved.append(ids)
    return resolved


class Embedder:
    """Serves Embed for the GenerationService servicer."""

    def __init__(self, state: GatewayState) -> None:
        self._state = state

    @maps_api_errors
    async def embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        arrival_time = time.time()
        request_id = request.request_id or f"embd-{uuid.uuid4().hex}"
        state = self._state
        sub_ids: list[str] = []
        done = False
        try:
            check_request_id(request_id)
            check_model_name(request.model)
            if state.longest_token_bytes:
                for i, item in enumerate(request.inputs):
                    if item.WhichOneof("input") == "text":
                        size = len(item.text.encode())
                        check_text_bytes(f"inputs[{i}].text", size, state.max_prompt_bytes)
            plan = plan_embed(request, request_id, state.facts)
            if not state.engines.live_engines and not state.engines.restart_expected:
                raise unavailable("no engine core is ready")
            token_ids = await state.in_pool(tokenize_inputs, state.tokenizer, plan.inputs)
            prompts = resolve_inputs(plan, token_ids, state.facts)
            await state.engines.wait_until_routable(context.time_remaining())
            channels = []
            for index, prompt in enumerate(prompts):
                sub_ids.append(f"{request_id}-{index}")
                engine_request = EngineCoreRequest(
                    request_id=sub_ids[-1],
                    prompt_token_ids=prompt,
                    pooling_params=plan.pooling,
                    arrival_time=arrival_time,
                    client_index=state.config.client_index,
                )
                channels.append(state.engines.add_request(engine_request))
            outputs = await asyncio.gather(*(_pooled_output(c) for c in channels))
            done = True
        finally:
            if sub_ids and not done:  # failed or cancelled: free the engine's work now
                state.engines.abort(sub_ids, "embed call failed or was cancelled")
        response = pb.EmbedResponse()
        for index, output in enumerate(outputs):
            vector = output.pooled_output or []
            response.results.add(index=index, data=vector, shape=[len(vector)])
        response.usage.prompt_tokens = sum(len(p) for p in prompts)
        response.usage.cached_prompt_tokens = sum(o.num_cached_tokens for o in outputs)
        logger.debug(
            "embed %s: %d input(s), %d tokens, %.1f ms",
            request_id,
            len(prompts),
            response.usage.prompt_tokens,
            (time.time() - arrival_time) * 1e3,
        )
        return response


async def _pooled_output(channel: RequestChannel) -> EngineCoreOutput:
    """Wait for one input's final output: its pooled vector, or the error that ended it."""
    while True:
        event = await channel.get()
        if isinstance(event, RequestFailed):
            raise event.error
        if isinstance(event, RequestAborted):
            raise ApiError(grpc.StatusCode.ABORTED, f"{channel.request_id}: {event.reason}")
        output = event.output
        if output.finish_reason is None:
            continue  # an intermediate step (nothing for a pooling request, but harmless)
        if output.finish_reason == FinishReason.STOP and output.pooled_output is not None:
            return output
        raise ApiError(
            grpc.StatusCode.INTERNAL,
            f"the engine failed to embed {channel.request_id} ({output.finish_reason})",
            reason="ENGINE_REQUEST_ERROR",
        )

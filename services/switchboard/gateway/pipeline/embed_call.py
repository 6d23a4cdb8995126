"""One Embed call: texts or token ids in, one pooled vector per input out.

    EmbedRequest -> request id, model name, how many inputs and each text's bytes (before
                    anything is echoed or tokenized)
                 -> plan_embed (checks that need no tokens, on the event loop)
                 -> tokenize the texts (one call in the tokenizer pool, special tokens added)
                 -> resolve_inputs (truncate_prompt_tokens, lengths, vocabulary)
                 -> one engine request per input, ``<request_id>-<index>``, with PoolingParams
                 -> every input's ``pooled_output`` -> PoolingResult per input, in input order

The checks are ``embed_validation.py``'s. The engine runs each input's prompt only (no
sampling) and answers with the pooled vector. Unset ``normalize`` and the pooling type come
from the checkpoint (``model_tasks.py``: its sentence-transformers files, else last-token
pooling for decoders), normalized by default. ``dimensions`` keeps the first N values
(Matryoshka) before normalizing. If the call fails or is cancelled, the inputs still in flight
are aborted on the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError, unavailable
from switchboard.gateway.engines.types import RequestAborted, RequestChannel, RequestFailed
from switchboard.gateway.pipeline.embed_validation import (
    check_input_sizes,
    plan_embed,
    resolve_inputs,
    tokenize_inputs,
)
from switchboard.gateway.pipeline.request_bounds import check_model_name, check_request_id
from switchboard.gateway.state import GatewayState
from switchboard.wire.engine_msgs import EngineCoreOutput, EngineCoreRequest, FinishReason

logger = logging.getLogger(__name__)


async def embed(
    state: GatewayState, request: pb.EmbedRequest, time_remaining: float | None
) -> pb.EmbedResponse:
    """Run one Embed call (``time_remaining``: the call's deadline, for an engine being
    restarted); ``ApiError`` if it fails."""
    arrival_time = time.time()
    request_id = request.request_id or f"embd-{uuid.uuid4().hex}"
    sub_ids: list[str] = []
    done = False
    try:
        check_request_id(request_id)
        check_model_name(request.model)
        check_input_sizes(request, state.max_prompt_bytes if state.longest_token_bytes else 0)
        plan = plan_embed(request, request_id, state.facts)
        if not state.engines.live_engines and not state.engines.restart_expected:
            raise unavailable("no engine core is ready")
        token_ids = await state.in_pool(tokenize_inputs, state.tokenizer, plan.inputs)
        prompts = resolve_inputs(plan, token_ids, state.facts)
        await state.engines.wait_until_routable(time_remaining)
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

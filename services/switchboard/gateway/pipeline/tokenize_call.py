"""Tokenize and Detokenize, for both fronts: the gRPC RPCs and vLLM's ``/tokenize`` and
``/detokenize``. Checks first (model or adapter, sizes, vocabulary), then one call in the
tokenizer pool."""

from __future__ import annotations

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument
from switchboard.gateway.chat.prompt import plan_chat, render_chat
from switchboard.gateway.pipeline.request_bounds import (
    check_model_name,
    check_text_bytes,
    prompt_bytes,
)
from switchboard.gateway.pipeline.validation import check_model_or_adapter
from switchboard.gateway.state import GatewayState


async def tokenize(state: GatewayState, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    await _check_model(state, request.model)
    if state.longest_token_bytes:
        check_text_bytes("text", len(request.text.encode()), state.max_prompt_bytes)
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    token_ids = await state.in_pool(state.tokenizer.encode, request.text, add_special)
    return _tokenized(state, token_ids, request.return_token_strs)


async def tokenize_chat(
    state: GatewayState, chat: pb.GenerateRequest, add_special_tokens: bool, token_strs: bool
) -> pb.TokenizeResponse:
    """``chat.messages`` rendered by the model's chat template (with ``chat``'s template
    options), then tokenized: the prompt a chat completion of them would have."""
    await _check_model(state, chat.model)
    if state.longest_token_bytes:
        check_text_bytes("messages", prompt_bytes(chat), state.max_prompt_bytes)
    plan = plan_chat(chat, state.chat_template, state.facts.name)
    template = state.chat_template
    assert plan is not None and template is not None  # messages given, else plan_chat raised

    def render_and_encode() -> list[int]:
        return state.tokenizer.encode(render_chat(template, plan), add_special_tokens)

    return _tokenized(state, await state.in_pool(render_and_encode), token_strs)


async def _check_model(state: GatewayState, model: str) -> None:
    """The served model, or an adapter (it shares the base model's tokenizer)."""
    check_model_name(model)  # before the lookup: the name is echoed in its errors
    await state.adapter_lookup.learn_names(model)  # an adapter loaded through another gateway
    check_model_or_adapter(model, state.facts)


def _tokenized(state: GatewayState, token_ids: list[int], token_strs: bool) -> pb.TokenizeResponse:
    response = pb.TokenizeResponse(token_ids=token_ids, max_model_len=state.facts.max_model_len)
    if token_strs:
        response.token_strs.extend(state.tokenizer.token_strs(token_ids))
    return response


async def detokenize(state: GatewayState, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
    await _check_model(state, request.model)
    vocab_size = state.tokenizer.vocab_size
    for i, token_id in enumerate(request.token_ids):
        if token_id >= vocab_size:
            raise invalid_argument(
                f"token_ids[{i}]",
                f"token_ids[{i}] = {token_id} is out of range: the tokenizer has "
                f"{vocab_size} tokens",
            )
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    text = await state.in_pool(state.tokenizer.decode, list(request.token_ids), skip)
    return pb.DetokenizeResponse(text=text)

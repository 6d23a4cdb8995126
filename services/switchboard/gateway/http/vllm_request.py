"""Bodies of the routes vLLM serves beside OpenAI's, and of ``/v1/embeddings``, -> the
gateway's protobuf requests (types checked here; value rules on the shared path)."""

from __future__ import annotations

import dataclasses
from typing import Any

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument
from switchboard.gateway.http.json_body import JsonBody, is_token_id
from switchboard.gateway.http.openai_request import read_chat_fields

ENCODING_FORMATS = ("float", "base64")


def embed_inputs(value: Any) -> list[pb.EmbedInput]:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [pb.EmbedInput(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [pb.EmbedInput(text=v) for v in value]
        if all(is_token_id(v) for v in value):
            return [pb.EmbedInput(token_ids=pb.TokenIds(ids=value))]
        if all(isinstance(v, list) and v and all(is_token_id(t) for t in v) for v in value):
            return [pb.EmbedInput(token_ids=pb.TokenIds(ids=v)) for v in value]
    raise invalid_argument(
        "input",
        "input must be a string, a non-empty array of strings, an array of token ids, or an "
        "array of arrays of token ids",
    )


@dataclasses.dataclass(frozen=True)
class EmbeddingsCall:
    request: pb.EmbedRequest
    encoding_format: str  # float | base64


def embeddings_request(raw: dict[str, Any], request_id: str) -> EmbeddingsCall:
    """POST /v1/embeddings (OpenAI's body, plus vLLM's ``truncate_prompt_tokens`` and
    ``normalize``); ``user`` and unknown fields are ignored, as on the other routes."""
    body = JsonBody(raw)
    request = pb.EmbedRequest(request_id=request_id, model=body.string("model") or "")
    request.inputs.extend(embed_inputs(raw.get("input")))
    encoding = body.string("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise invalid_argument(
            "encoding_format", f"encoding_format must be float or base64, got {encoding!r}"
        )
    dimensions = body.uint("dimensions")
    if dimensions is not None:
        request.dimensions = dimensions
    truncate = body.uint("truncate_prompt_tokens")
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    normalize = body.boolean("normalize")
    if normalize is not None:
        request.normalize = normalize
    return EmbeddingsCall(request, encoding)


@dataclasses.dataclass(frozen=True)
class TokenizeCall:
    """``/tokenize`` of a prompt (``request``) or of chat messages (``chat``)."""

    request: pb.TokenizeRequest | None
    chat: pb.GenerateRequest | None
    add_special_tokens: bool
    return_token_strs: bool


def tokenize_request(raw: dict[str, Any]) -> TokenizeCall:
    """vLLM's TokenizeCompletionRequest (``prompt``; special tokens added by default) or
    TokenizeChatRequest (``messages`` through the chat template; none added by default)."""
    body = JsonBody(raw)
    model = body.string("model") or ""
    token_strs = bool(body.boolean("return_token_strs"))
    add_special = body.boolean("add_special_tokens")
    if raw.get("messages") is None:
        prompt = body.string("prompt")
        if prompt is None:
            raise invalid_argument("prompt", "set prompt (a string) or messages")
        request = pb.TokenizeRequest(model=model, text=prompt, return_token_strs=token_strs)
        if add_special is not None:
            request.add_special_tokens = add_special
        return TokenizeCall(request, None, add_special is not False, token_strs)
    if raw.get("prompt") is not None:
        raise invalid_argument("messages", "set either prompt or messages, not both")
    chat = pb.GenerateRequest(model=model)
    read_chat_fields(body, raw, chat)
    return TokenizeCall(None, chat, bool(add_special), token_strs)


def detokenize_request(raw: dict[str, Any]) -> pb.DetokenizeRequest:
    """vLLM's DetokenizeRequest: ``tokens``, decoded as vLLM does, special tokens kept."""
    body = JsonBody(raw)
    if raw.get("tokens") is None:
        raise invalid_argument("tokens", "tokens (an array of token ids) is required")
    return pb.DetokenizeRequest(
        model=body.string("model") or "",
        token_ids=body.uint_list("tokens"),
        skip_special_tokens=False,
    )

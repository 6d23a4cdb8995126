"""Chat messages -> prompt token ids: the model's chat template, rendered in the tokenizer pool.

The rendered text already holds the template's special tokens (BOS included), so it is
tokenized with ``add_special_tokens=False``, as transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import grpc

from switchboard.gateway.errors import ApiError
from switchboard.gateway.http.openai_request import ChatPrompt
from switchboard.gateway.state import GatewayState


async def render_chat(state: GatewayState, chat: ChatPrompt) -> list[int]:
    raise ApiError(
        grpc.StatusCode.UNIMPLEMENTED,
        "/v1/chat/completions is not available yet: this gateway has no chat templates",
        reason="CHAT_NOT_IMPLEMENTED",
    )

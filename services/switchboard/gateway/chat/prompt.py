"""A GenerateRequest's chat ``messages`` -> prompt token ids, through the model's chat template.

Two halves, like the rest of validation: ``plan_chat`` checks the chat fields on the event loop
(no template: FAILED_PRECONDITION; a prompt and messages together, or chat options without
messages: INVALID_ARGUMENT), ``chat_prompt_token_ids`` renders and tokenizes in the tokenizer
thread pool (a template can be slow, and it is untrusted code). The rendered text is tokenized
without adding special tokens, as transformers' ``apply_chat_template(tokenize=True)`` does: the
template writes BOS and the turn markers itself, a second BOS would change the prompt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import grpc
from google.protobuf import json_format

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import ApiError, invalid_argument
from switchboard.gateway.chat.template import RESERVED_VARIABLES, ChatTemplate, ChatTemplateError
from switchboard.gateway.text import Tokenizer

NO_TEMPLATE_HINT = (
    "give the server one with `--chat-template FILE` (a Jinja file), or send a prompt "
    "(text / token_ids) instead of messages"
)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """The validated chat fields of one request, waiting to be rendered."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any]
    tools: list[dict[str, Any]] | None = None  # the template's ``tools`` (None: no tools)


def no_chat_template(model_name: str) -> ApiError:
    return ApiError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"model {model_name!r} has no chat template, so it cannot take messages: "
        f"{NO_TEMPLATE_HINT}",
        reason="NO_CHAT_TEMPLATE",
        field="messages",
    )


def _check_chat_options_unused(request: pb.GenerateRequest) -> None:
    """Chat options without messages would be ignored: refuse them instead."""
    used = [
        name
        for name, is_set in (
            ("add_generation_prompt", request.HasField("add_generation_prompt")),
            ("continue_final_message", request.continue_final_message),
            ("chat_template_kwargs", request.HasField("chat_template_kwargs")),
            ("tools", bool(request.tools)),
        )
        if is_set
    ]
    if used:
        raise invalid_argument(used[0], f"{used[0]} applies to messages only: set messages")


def _json_or_text(text: str) -> Any:
    """A tool call's arguments for the template: a JSON object parsed (templates write it with
    ``tojson``, as transformers' and vLLM's callers pass dicts), anything else as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _message_dict(i: int, message: pb.ChatMessage) -> dict[str, Any]:
    if not message.role:
        raise invalid_argument(f"messages[{i}].role", f"messages[{i}].role must not be empty")
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.HasField("name"):
        entry["name"] = message.name
    if message.tool_calls:
        if not message.content:  # OpenAI's content: null beside calls; transformers drops it
            del entry["content"]
        calls = []
        for j, call in enumerate(message.tool_calls):
            if not call.function.name:
                field = f"messages[{i}].tool_calls[{j}].function.name"
                raise invalid_argument(field, f"{field} must not be empty")
            calls.append(
                {
                    "id": call.id,
                    "type": call.type or "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
            )
        entry["tool_calls"] = calls
    if message.HasField("tool_call_id"):
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _tool_dicts(tools: Any) -> list[dict[str, Any]]:
    """``GenerateRequest.tools`` -> the OpenAI shape templates read; the parameters parsed."""
    result = []
    for i, tool in enumerate(tools):
        if tool.type not in ("", "function"):
            raise invalid_argument(f"tools[{i}].type", f'tools[{i}].type must be "function"')
        function = tool.function
        if not function.name:
            raise invalid_argument(
                f"tools[{i}].function.name", f"tools[{i}].function.name must not be empty"
            )
        entry: dict[str, Any] = {"name": function.name}
        if function.HasField("description"):
            entry["description"] = function.description
        if function.parameters:
            try:
                parameters = json.loads(function.parameters)
            except ValueError as error:
                field = f"tools[{i}].function.parameters"
                raise invalid_argument(field, f"{field}: not valid JSON ({error})") from None
            if not isinstance(parameters, dict):
                field = f"tools[{i}].function.parameters"
                raise invalid_argument(field, f"{field}: a JSON Schema object")
            entry["parameters"] = parameters
        if function.HasField("strict"):
            entry["strict"] = function.strict
        result.append({"type": "function", "function": entry})
    return result


def plan_chat(
    request: pb.GenerateRequest, template: ChatTemplate | None, model_name: str
) -> ChatPrompt | None:
    """The request's chat fields, checked; None when it sends a prompt instead."""
    if not request.messages:
        _check_chat_options_unused(request)
        return None
    if request.WhichOneof("prompt") is not None:
        raise invalid_argument(
            "messages",
            f"messages: set either a prompt ({request.WhichOneof('prompt')}) or messages, not both",
        )
    if template is None:
        raise no_chat_template(model_name)
    messages = [_message_dict(i, m) for i, m in enumerate(request.messages)]
    explicit = request.HasField("add_generation_prompt")
    if request.continue_final_message and explicit and request.add_generation_prompt:
        raise invalid_argument(
            "continue_final_message",
            "continue_final_message: the final message is continued, so no generation prompt "
            "can follow it: unset add_generation_prompt (or set it false)",
        )
    kwargs: dict[str, Any] = {}
    if request.HasField("chat_template_kwargs"):
        kwargs = json_format.MessageToDict(request.chat_template_kwargs)
        reserved = sorted(RESERVED_VARIABLES & kwargs.keys())
        if reserved:
            raise invalid_argument(
                "chat_template_kwargs",
                f"chat_template_kwargs must not set {', '.join(reserved)}: the request does",
            )
    return ChatPrompt(
        messages=messages,
        add_generation_prompt=(
            request.add_generation_prompt if explicit else not request.continue_final_message
        ),
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=kwargs,
        tools=_tool_dicts(request.tools) if request.tools else None,
    )


def render_chat(template: ChatTemplate, chat: ChatPrompt) -> str:
    """The prompt text; INVALID_ARGUMENT with the template's message when it fails."""
    try:
        text = template.render(
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            tools=chat.tools,
            chat_template_kwargs=chat.chat_template_kwargs,
        )
    except ChatTemplateError as error:
        raise invalid_argument("messages", str(error), reason="CHAT_TEMPLATE_ERROR") from error
    if not text:
        raise invalid_argument("messages", "messages: the chat template rendered an empty prompt")
    return text


def chat_prompt_token_ids(
    template: ChatTemplate, tokenizer: Tokenizer, chat: ChatPrompt
) -> list[int]:
    """Render and tokenize (in the tokenizer pool): no special tokens are added, the template
    wrote them."""
    return tokenizer.encode(render_chat(template, chat), add_special_tokens=False)

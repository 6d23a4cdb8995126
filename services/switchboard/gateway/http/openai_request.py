"""OpenAI request bodies -> ``pb.GenerateRequest``: the types here, the value rules downstream.

This module only checks JSON types (a string where a number belongs is a 400 naming the
parameter) and the few OpenAI-only rules; every value rule (temperature >= 0, top_p in (0, 1],
n <= 64 ...) is the one ``plan_generate`` applies to gRPC requests, so the two fronts agree.
Parameters the gateway cannot honour are refused, never silently dropped; parameters it does
not know are ignored (OpenAI clients send ``user``, ``metadata`` and friends).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.errors import invalid_argument, not_supported

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_UINT32_MAX = (1 << 32) - 1


@dataclasses.dataclass(frozen=True)
class OpenAIOptions:
    """What shapes the answer rather than the generation."""

    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-N; chat: top_logprobs when logprobs is true


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid_argument("body", f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise invalid_argument("body", "the request body must be a JSON object")
    return body


class _Body:
    """Typed reads of one JSON body; a wrong type is a 400 naming the parameter."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def _get(self, name: str, types: tuple[type, ...], what: str) -> Any:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in types:
            raise invalid_argument(name, f"{name} must be {what}, got {value!r}")
        if not isinstance(value, types):
            raise invalid_argument(name, f"{name} must be {what}, got {value!r}")
        return value

    def number(self, name: str) -> float | None:
        value = self._get(name, (int, float), "a number")
        return None if value is None else float(value)

    def integer(self, name: str) -> int | None:
        return self._get(name, (int,), "an integer")

    def int_in(self, name: str, bits: int) -> int | None:
        """A signed integer of ``bits`` bits (the proto field's)."""
        value = self.integer(name)
        if value is not None and not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
            raise invalid_argument(name, f"{name} is out of range: {value}")
        return value

    def uint(self, name: str) -> int | None:
        value = self.integer(name)
        if value is not None and not 0 <= value <= _UINT32_MAX:
            raise invalid_argument(name, f"{name} must be a non-negative integer, got {value}")
        return value

    def boolean(self, name: str) -> bool | None:
        return self._get(name, (bool,), "a boolean")

    def string(self, name: str) -> str | None:
        return self._get(name, (str,), "a string")

    def object(self, name: str) -> dict[str, Any] | None:
        return self._get(name, (dict,), "an object")

    def array(self, name: str) -> list[Any] | None:
        return self._get(name, (list,), "an array")

    def uint_list(self, name: str) -> list[int]:
        values = self.array(name) or []
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise invalid_argument(name, f"{name} must be an array of token ids")
        return values

    def str_list(self, name: str) -> list[str]:
        value = self.body.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise invalid_argument(name, f"{name} must be a string or an array of strings")


def _refuse(body: _Body, *names: str) -> None:
    for name in names:
        if body.body.get(name) is not None:
            raise not_supported(name, name)


def _common(body: _Body, request: pb.GenerateRequest, max_tokens: int | None) -> OpenAIOptions:
    """The parameters /v1/completions and /v1/chat/completions share."""
    b = body
    _refuse(b, "suffix", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    best_of = b.uint("best_of")
    if best_of is not None and best_of > (b.uint("n") or 1):
        raise not_supported("best_of", "best_of > n")
    response_format = b.object("response_format")
    if response_format is not None and response_format.get("type", "text") != "text":
        raise not_supported("response_format", "structured output (response_format)")
    request.model = b.string("model") or ""
    s, st, o = request.sampling, request.stopping, request.output
    for name in ("temperature", "top_p", "min_p"):
        value = b.number(name)
        if value is not None:
            setattr(s, name, value)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = b.number(name)
        if value is not None:
            setattr(s, name, value)
    top_k = b.int_in("top_k", 32)
    if top_k is not None:
        s.top_k = top_k
    seed = b.int_in("seed", 64)
    if seed is not None:
        s.seed = seed
    n = b.uint("n")
    if n is not None:
        s.n = n
    for key, bias in (b.object("logit_bias") or {}).items():
        if not str(key).isdigit() or isinstance(bias, bool) or not isinstance(bias, int | float):
            raise invalid_argument("logit_bias", "logit_bias maps token ids to numbers")
        s.logit_bias[int(key)] = float(bias)
    s.allowed_token_ids.extend(b.uint_list("allowed_token_ids"))
    s.bad_words.extend(b.str_list("bad_words"))
    if max_tokens is not None:
        st.max_tokens = max_tokens
    st.min_tokens = b.uint("min_tokens") or 0
    st.stop.extend(b.str_list("stop"))
    st.stop_token_ids.extend(b.uint_list("stop_token_ids"))
    st.include_stop_str_in_output = bool(b.boolean("include_stop_str_in_output"))
    st.ignore_eos = bool(b.boolean("ignore_eos"))
    skip_special_tokens = b.boolean("skip_special_tokens")
    if skip_special_tokens is not None:
        o.skip_special_tokens = skip_special_tokens
    priority = b.int_in("priority", 32)
    if priority is not None:
        request.priority = priority
    request.cache_salt = b.string("cache_salt") or ""
    truncate = b.uint("truncate_prompt_tokens")
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    stream = bool(b.boolean("stream"))
    stream_options = b.object("stream_options")
    if stream_options is not None and not stream:
        raise invalid_argument("stream_options", "stream_options is only allowed with stream")
    include_usage = bool((stream_options or {}).get("include_usage"))
    o.kind = pb.OUTPUT_KIND_DELTA if stream else pb.OUTPUT_KIND_FINAL_ONLY
    return OpenAIOptions(stream=stream, include_usage=include_usage, logprobs=None)


def _max_tokens(body: _Body, *names: str) -> int | None:
    for name in names:
        value = body.uint(name)
        if value is not None:
            return value
    return None


def completion_request(
    raw: dict[str, Any], request_id: str
) -> tuple[pb.GenerateRequest, OpenAIOptions]:
    """POST /v1/completions: one prompt (a string or token ids)."""
    body = _Body(raw)
    if body.boolean("echo"):
        raise not_supported("echo", "echo")
    request = pb.GenerateRequest(request_id=request_id)
    max_tokens = _max_tokens(body, "max_tokens")
    if raw.get("max_tokens") is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    options = _common(body, request, max_tokens)
    prompt = raw.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        request.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise not_supported("prompt", "a batch of several prompts (send one request each)")
    else:
        raise invalid_argument("prompt", "prompt must be a string or an array of token ids")
    logprobs = body.uint("logprobs")
    if logprobs is not None:
        request.output.logprobs = logprobs
    return request, dataclasses.replace(options, logprobs=logprobs)


def chat_request(raw: dict[str, Any], request_id: str) -> tuple[pb.GenerateRequest, OpenAIOptions]:
    """POST /v1/chat/completions: the messages go into ``GenerateRequest.messages``, rendered by
    the model's chat template on the shared path (``gateway/chat/``), as for gRPC."""
    body = _Body(raw)
    _refuse(body, "functions", "function_call", "audio", "prediction")
    if body.boolean("echo"):
        raise not_supported("echo", "echo")
    if body.array("tools") and raw.get("tool_choice") != "none":
        raise not_supported("tools", "tool calling (tools)")
    tool_choice = raw.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise not_supported("tool_choice", "tool_choice other than none or auto")
    modalities = body.array("modalities")
    if modalities is not None and modalities != ["text"]:
        raise not_supported("modalities", "output modalities other than text")
    request = pb.GenerateRequest(request_id=request_id)
    options = _common(body, request, _max_tokens(body, "max_completion_tokens", "max_tokens"))
    top_logprobs = body.uint("top_logprobs")
    logprobs = None
    if body.boolean("logprobs"):
        logprobs = top_logprobs or 0
        request.output.logprobs = logprobs
    elif top_logprobs:
        raise invalid_argument("top_logprobs", "top_logprobs needs logprobs: true")
    request.messages.extend(chat_messages(raw.get("messages")))
    add_generation_prompt = body.boolean("add_generation_prompt")
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    request.continue_final_message = bool(body.boolean("continue_final_message"))
    kwargs = body.object("chat_template_kwargs")
    if kwargs:
        request.chat_template_kwargs.update(kwargs)
    return request, dataclasses.replace(options, logprobs=logprobs)


def chat_messages(messages: Any) -> list[pb.ChatMessage]:
    """Check the messages; text parts (``[{"type": "text", "text": ...}]``) become one string,
    as the templates of text models expect. Images, audio, files and tool calls are refused."""
    if not isinstance(messages, list) or not messages:
        raise invalid_argument("messages", "messages must be a non-empty array")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_argument("messages", f"messages[{i}] must be an object with a role")
        if message.get("tool_calls") or message.get("tool_call_id"):
            raise not_supported("messages", "tool calls in messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise not_supported("messages", "content parts other than text")
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise invalid_argument("messages", f"messages[{i}].content must be a string")
        entry = pb.ChatMessage(role=message["role"], content=content or "")
        name = message.get("name")
        if isinstance(name, str):
            entry.name = name
        result.append(entry)
    return result


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

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
import re
from typing import Any

from switchboard.api.v1 import generation_service_pb2 as pb
from switchboard.gateway.api_errors import invalid_argument, not_supported
from switchboard.gateway.chat.tools import ToolPlan, forced_call_schema
from switchboard.gateway.http.json_body import JsonBody, is_token_id
from switchboard.gateway.pipeline.constraint_check import from_openai_response_format

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# vLLM's body fields for constrained decoding -> the StructuredOutput kind each sets.
_GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclasses.dataclass(frozen=True)
class OpenAIOptions:
    """What shapes the answer rather than the generation."""

    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-N; chat: top_logprobs when logprobs is true
    # The body field whose constraint went into structured_output (its errors name it).
    constraint_param: str | None = None
    tools: ToolPlan | None = None  # chat: tool calls to parse out of the answer


def _refuse(body: JsonBody, *names: str) -> None:
    for name in names:
        if body.body.get(name) is not None:
            raise not_supported(name, name)


def _common(body: JsonBody, request: pb.GenerateRequest, max_tokens: int | None) -> OpenAIOptions:
    """The parameters /v1/completions and /v1/chat/completions share."""
    b = body
    _refuse(b, "suffix", "guided_whitespace_pattern", "structured_outputs")
    best_of = b.uint("best_of")
    if best_of is not None and best_of > (b.uint("n") or 1):
        raise not_supported("best_of", "best_of > n")
    constraint_param = _structured_output(b, request.structured_output)
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
    return OpenAIOptions(
        stream=stream, include_usage=include_usage, logprobs=None, constraint_param=constraint_param
    )


def _structured_output(body: JsonBody, so: pb.StructuredOutput) -> str | None:
    """``response_format`` (OpenAI) or one of vLLM's ``guided_*`` fields -> ``so``; the name of
    the field used (None: unconstrained). Two constraints at once are refused."""
    used = [name for name in _GUIDED_FIELDS if body.body.get(name) is not None]
    params = from_openai_response_format(body.body.get("response_format"))
    if params is not None:
        used.insert(0, "response_format")
    if len(used) > 1:
        raise invalid_argument(used[1], f"{used[1]}: only one of {', '.join(used)} may be set")
    if params is not None:
        if params.kind == "json_object":
            so.json_object = True
        else:
            so.json_schema = params.spec
        return "response_format"
    if not used:
        return None
    name = used[0]
    value = body.body[name]
    kind = _GUIDED_FIELDS[name]
    if kind == "json_schema" and isinstance(value, dict | bool):
        value = json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise invalid_argument(name, f"{name} must be an array of strings")
        so.choice.values.extend(value)
    elif not isinstance(value, str):
        raise invalid_argument(name, f"{name} must be a string")
    else:
        setattr(so, kind, value)
    return name


def _max_tokens(body: JsonBody, *names: str) -> int | None:
    for name in names:
        value = body.uint(name)
        if value is not None:
            return value
    return None


def completion_request(
    raw: dict[str, Any], request_id: str
) -> tuple[pb.GenerateRequest, OpenAIOptions]:
    """POST /v1/completions: one prompt (a string or token ids)."""
    body = JsonBody(raw)
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
    elif isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt):
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
    body = JsonBody(raw)
    _refuse(body, "functions", "function_call", "audio", "prediction")
    if body.boolean("echo"):
        raise not_supported("echo", "echo")
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
    read_chat_fields(body, raw, request)
    options = dataclasses.replace(options, logprobs=logprobs)
    return request, _tools(body, request, options)


def _tools(body: JsonBody, request: pb.GenerateRequest, options: OpenAIOptions) -> OpenAIOptions:
    """``tools`` + ``tool_choice``: the tools into the request (rendered by the template) unless
    the choice is ``none``; a forced choice (``required`` / a named function) constrains the
    output to one call's JSON, which then needs every other constraint unset."""
    functions = _functions(body.array("tools") or [])
    choice, only = _tool_choice(body.body.get("tool_choice"), functions)
    parallel = body.boolean("parallel_tool_calls")
    if choice == "none" or not functions:  # "auto" without tools: nothing to call
        return options
    for name, function in functions.items():
        tool = request.tools.add(type="function")
        tool.function.name = name
        if function.get("description") is not None:
            tool.function.description = function["description"]
        if function.get("parameters") is not None:
            tool.function.parameters = json.dumps(function["parameters"], ensure_ascii=False)
        if function.get("strict") is not None:
            tool.function.strict = function["strict"]
    plan = ToolPlan(mode="auto", names=frozenset(functions), parallel=parallel is not False)
    if choice == "auto":
        return dataclasses.replace(options, tools=plan)
    if options.constraint_param is not None:
        raise invalid_argument(
            "tool_choice",
            f"tool_choice {choice!r} constrains the output to a tool call: "
            f"{options.constraint_param} cannot be set with it",
        )
    parameters = {name: function.get("parameters") for name, function in functions.items()}
    schema = forced_call_schema(parameters, only)
    request.structured_output.json_schema = json.dumps(schema, ensure_ascii=False)
    return dataclasses.replace(
        options, tools=dataclasses.replace(plan, mode="forced"), constraint_param="tools"
    )


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """OpenAI function tools, checked -> name: the ``function`` object."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise not_supported("tools", f'tools[{i}]: tools other than {{"type": "function"}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_argument("tools", f"tools[{i}].function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise invalid_argument(
                "tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -"
            )
        if name in functions:
            raise invalid_argument("tools", f"tools[{i}]: the function {name!r} is there twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid_argument(
                "tools", f"tools[{i}].function.parameters must be a JSON Schema object"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_argument("tools", f"tools[{i}].function.description must be a string")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_argument("tools", f"tools[{i}].function.strict must be a boolean")
        functions[name] = function
    return functions


def _tool_choice(value: Any, functions: dict[str, Any]) -> tuple[str, str | None]:
    """(none | auto | required | function, the named function)."""
    if value is None:
        return ("auto" if functions else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not functions:
            raise invalid_argument("tool_choice", "tool_choice required needs tools")
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in functions:
            raise invalid_argument(
                "tool_choice", f"tool_choice names a function that is not in tools: {name!r}"
            )
        return "function", name
    raise invalid_argument(
        "tool_choice",
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
    )


def read_chat_fields(body: JsonBody, raw: dict[str, Any], request: pb.GenerateRequest) -> None:
    """The chat fields a chat completion and vLLM's chat ``/tokenize`` both take: the messages
    and how the chat template renders them."""
    request.messages.extend(chat_messages(raw.get("messages")))
    add_generation_prompt = body.boolean("add_generation_prompt")
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    request.continue_final_message = bool(body.boolean("continue_final_message"))
    kwargs = body.object("chat_template_kwargs")
    if kwargs:
        request.chat_template_kwargs.update(kwargs)


def chat_messages(messages: Any) -> list[pb.ChatMessage]:
    """Check the messages; text parts (``[{"type": "text", "text": ...}]``) become one string,
    as the templates of text models expect. An assistant's ``tool_calls`` and a tool message's
    ``tool_call_id`` are kept; images, audio and files are refused."""
    if not isinstance(messages, list) or not messages:
        raise invalid_argument("messages", "messages must be a non-empty array")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_argument("messages", f"messages[{i}] must be an object with a role")
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
        tool_call_id = message.get("tool_call_id")
        if tool_call_id is not None:
            if not isinstance(tool_call_id, str):
                raise invalid_argument("messages", f"messages[{i}].tool_call_id must be a string")
            entry.tool_call_id = tool_call_id
        entry.tool_calls.extend(_message_tool_calls(i, message.get("tool_calls")))
        result.append(entry)
    return result


def _message_tool_calls(i: int, calls: Any) -> list[pb.ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid_argument("messages", f"messages[{i}].tool_calls must be an array")
    result = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_argument("messages", f"{where} must have a function with a name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise invalid_argument("messages", f"{where}.function.arguments must be JSON text")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise invalid_argument("messages", f"{where}.id must be a string")
        entry = pb.ToolCall(id=call_id, type=str(call.get("type") or "function"))
        entry.function.name = function["name"]
        entry.function.arguments = arguments
        result.append(entry)
    return result

"""Tool calls on the OpenAI front: the constraint of a forced call and the parser of free ones.

``tool_choice`` decides (``ToolPlan.mode``):

- ``forced`` (``required`` or a named function): the output is constrained to a JSON schema
  describing one call, ``{"name": <const>, "arguments": <the function's parameters>}`` (for
  ``required`` an ``anyOf`` over the functions), so it always parses into one call.
- ``auto``: the chat template shows the model the tools and the output is searched for
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (the Hermes / Qwen
  convention, ``parse_tool_calls``); what is left is the message's content.
- ``none``: neither; the tools are not rendered either (the model is not to call one).

The OpenAI objects built here: ``{"id": "call_<hex>", "type": "function", "function": {"name",
"arguments": <JSON text>}}``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# A closed block, or an unclosed one at the very end (the model stopped before closing it).
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What the answer of one chat request does with tool calls."""

    mode: str  # "forced" | "auto"
    names: frozenset[str]  # the functions the request offers
    parallel: bool = True  # auto: keep every call found (parallel_tool_calls), else the first


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_object(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call of ``name``: its arguments follow its parameters schema."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": parameters if parameters is not None else _NO_PARAMETERS,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(functions: dict[str, dict[str, Any] | None], only: str | None) -> dict:
    """``tool_choice`` named (``only``) -> that function's call; ``required`` -> any of them."""
    if only is not None:
        return call_schema(only, functions[only])
    schemas = [call_schema(name, parameters) for name, parameters in functions.items()]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def parse_forced_call(text: str) -> dict[str, Any] | None:
    """The call a constrained output spells; None when it does not (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" not in value:
        return None
    return tool_call_object(value["name"], value["arguments"])


def _block_call(body: str, names: frozenset[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(name, str) or name not in names:
        return None
    if not isinstance(arguments, dict | str):
        return None
    return tool_call_object(name, arguments)


def parse_tool_calls(
    text: str, names: frozenset[str], parallel: bool = True
) -> tuple[str | None, list[dict[str, Any]]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks -> calls; the rest of
    the text (stripped, None when nothing is left) is the content. A block that is not a JSON
    object with a ``name`` the request offers stays in the content, as written. With
    ``parallel`` false only the first call is kept (the later blocks are dropped)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        call = _block_call(body.strip(), names)
        kept.append(text[at : match.start()])
        if call is None:
            kept.append(match.group(0))
        elif parallel or not calls:
            calls.append(call)
        at = match.end()
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class AutoToolStream:
    """One streamed choice under ``tool_choice: auto``: text is passed on as content until a
    ``<tool_call>`` may begin; from there on it is held back, and parsed when the choice ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        if self._in_call:
            self._held += text
            return ""
        text = self._held + text
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._in_call = True
            self._held = text[at:]
            return text[:at]
        keep = _partial_open_tag(text)  # "...<tool_" might become a tag: hold it back
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the content still to send, the calls) when the choice ends."""
        held, self._held = self._held, ""
        if not self._in_call:
            return held, []
        content, calls = parse_tool_calls(held, self._plan.names, self._plan.parallel)
        if not calls:
            return held, []
        return content or "", calls


def _partial_open_tag(text: str) -> int:
    """The length of the longest end of ``text`` that starts ``<tool_call>``."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0

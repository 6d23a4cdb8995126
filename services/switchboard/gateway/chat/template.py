"""A checkpoint's chat template, found and rendered the way transformers' ``apply_chat_template``
does, without importing transformers (the gateway image has neither it nor torch).

Templates come from the Hub and are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` with the globals and filters transformers gives them
(``raise_exception``, ``strftime_now``, a ``tojson`` that does not HTML-escape, a ``dict`` and a
``namespace`` that cannot be used to reach Python internals), and everything they see is
rebuilt from plain JSON types first. Rendering matches transformers'
``render_jinja_template`` (``trim_blocks``, ``lstrip_blocks``, the loopcontrols extension, keys
whose value is None dropped from messages, ``continue_final_message`` cut at the end of the
final message's text) so that a prompt is token for token what ``apply_chat_template`` makes.

Where the template comes from, first hit wins: an override file (``--chat-template FILE``), the
checkpoint's ``chat_template.jinja``, ``tokenizer_config.json``'s ``chat_template`` (a string, or
a list of named templates of which "default" is taken).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

# The names a template's render call fills itself; chat_template_kwargs must not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# What transformers appends to the final message to find where its text ends in the render.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Older names of a message's reasoning; templates read the first (gpt-oss ones read "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that cannot be loaded or fails to render; the message says why (for a render,
    often the template's own words, from ``raise_exception``)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str  # the Jinja text
    bos_token: str  # "" = the tokenizer has none (the template then sees it undefined)
    eos_token: str

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages``. Tokenize it without adding special tokens: the
        template writes them (transformers' ``apply_chat_template(tokenize=True)`` does the same).

        ``continue_final_message`` leaves the final message open for the model to continue
        (a prefilled answer); it needs no generation prompt, so ``add_generation_prompt`` is
        ignored with it. Raises ChatTemplateError when the template refuses the messages or
        fails.
        """
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_VARIABLES & extra.keys())
        if reserved:
            raise ChatTemplateError(
                f"chat_template_kwargs must not set {', '.join(reserved)}: the request sets it"
            )
        chat = _template_data(_drop_none_values(messages))
        if not isinstance(chat, list) or not all(isinstance(m, dict) for m in chat):
            raise ChatTemplateError("messages must be a list of objects")
        chat = _alias_reasoning(chat)
        continued_text = self._tag_final_message(chat) if continue_final_message else None
        variables: dict[str, Any] = {}
        if self.bos_token:
            variables["bos_token"] = self.bos_token
        if self.eos_token:
            variables["eos_token"] = self.eos_token
        variables.update(_template_data(extra))  # kwargs win over the special tokens
        try:
            rendered = _compile(self.source).render(
                messages=chat,
                tools=_template_data(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **variables,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template: {error.message or error}") from error
        except Exception as error:  # the template's own bug (a TypeError, a KeyError ...)
            raise ChatTemplateError(
                f"chat template failed: {type(error).__name__}: {error}"
            ) from error
        if continued_text is not None:
            rendered = _cut_at_tag(rendered, continued_text)
        return rendered

    def _tag_final_message(self, chat: list[dict[str, Any]]) -> str:
        """Append the tag to the final message's text (in place); return that text."""
        if not chat:
            raise ChatTemplateError("continue_final_message needs at least one message")
        final = chat[-1]
        content = final.get("content")
        if content is None:
            raise ChatTemplateError(
                'continue_final_message: the final message has no "content" to continue'
            )
        if "content" not in self.source:
            raise ChatTemplateError(
                'continue_final_message: this chat template does not read a message\'s "content"'
            )
        if isinstance(content, list):
            for block in reversed(content):
                if isinstance(block, dict) and isinstance(block.get("text"), str):
                    text = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    return text
            raise ChatTemplateError(
                "continue_final_message: the final message has no text to continue"
            )
        if not isinstance(content, str):
            raise ChatTemplateError(
                "continue_final_message: the final message's content is no text"
            )
        final["content"] = content + _CONTINUE_TAG
        return content


def _cut_at_tag(rendered: str, final_text: str) -> str:
    """Everything before the final message's end (its end-of-turn tokens are cut off)."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat "
            "(the chat template changes or drops it)"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def _drop_none_values(messages: Any) -> Any:
    """transformers drops a message's keys whose value is None (OpenAI's ``content: null``):
    many templates render a literal "None" otherwise, yet cope with a missing key."""
    if not isinstance(messages, list):
        return messages
    return [
        {k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m
        for m in messages
    ]


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _template_data(value: Any) -> Any:
    """A copy of ``value`` built from plain JSON types only: the sandbox does not know the
    methods of richer objects, so none reaches the template (others become ``"<TypeName>"``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_template_data(k): _template_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_template_data(v) for v in value]
    return f"<{type(value).__name__}>"


# -- the environment: transformers' globals and filters ---------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which no prompt wants.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates, without the class itself (no attribute hacks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reaching into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store underscore-prefixed attributes ({name!r}) on a "
                "namespace"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers marks assistant text with it for
    training masks): rendered as its body, so such templates work here too."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"chat template syntax error, line {error.lineno}: {error.message}"
        ) from error


# -- finding a checkpoint's template ------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return ""


def _config_template(value: Any, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        default = named.get("default")
        if isinstance(default, str) and default:
            return default
        if named:
            return None  # named templates but no default: none is the chat template
    raise ChatTemplateError(f"{path}: chat_template is neither a string nor a list of templates")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ChatTemplateError(f"cannot read chat template {path}: {error.strerror}") from error


def load_chat_template(model_dir: str, override_path: str | None = None) -> ChatTemplate | None:
    """The chat template of the checkpoint in ``model_dir`` (``override_path``, a Jinja file,
    wins), compiled once to fail now on a syntax error; None when there is none."""
    tokenizer_config_path = os.path.join(model_dir, "tokenizer_config.json")
    tokenizer_config = _read_json(tokenizer_config_path)
    special = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if override_path:
        source: str | None = _read_text(override_path)
    elif os.path.exists(jinja_path):
        source = _read_text(jinja_path)
    else:
        source = _config_template(tokenizer_config.get("chat_template"), tokenizer_config_path)
    if not source:
        return None
    _compile(source)

    def token(name: str) -> str:
        return _token_text(tokenizer_config.get(name)) or _token_text(special.get(name))

    return ChatTemplate(source=source, bos_token=token("bos_token"), eos_token=token("eos_token"))

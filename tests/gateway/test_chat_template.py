"""The chat template renderer (gateway/chat/template.py) against transformers'
``apply_chat_template``: the same prompt token ids for the default model and for a tiny
checkpoint with a template, the same text for the Jinja features templates use, and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from switchboard.checkpoint import resolve_model
from switchboard.gateway.chat.template import ChatTemplate, ChatTemplateError, load_chat_template
from switchboard.gateway.text import Tokenizer
from tests.tiny_checkpoint import BOS_TOKEN, TINY_CHAT_TEMPLATE, tiny_llama_dir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "Answer in one word."}, *QUESTION],
    [
        *QUESTION,
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": 'And of Italy? ünïcödé, emoji 🙂, <b>tags</b> & "quotes"'},
    ],
]


def _reference_ids(model_dir: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def _reference_text(model_dir: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _our_ids(model_dir: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    template = load_chat_template(model_dir)
    assert template is not None
    text = template.render(messages, **kwargs)
    return Tokenizer.from_model_dir(model_dir).encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    return resolve_model(None)  # the built-in default model (converted once, then cached)


@pytest.fixture(scope="module")
def tiny_chat_dir() -> str:
    return tiny_llama_dir(chat_template=TINY_CHAT_TEMPLATE)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_default_model_prompt_ids_match_transformers(smollm2_dir: str, messages) -> None:
    expected = _reference_ids(smollm2_dir, messages, add_generation_prompt=True)
    assert _our_ids(smollm2_dir, messages) == expected


def test_default_model_without_generation_prompt(smollm2_dir: str) -> None:
    expected = _reference_ids(smollm2_dir, CONVERSATIONS[2], add_generation_prompt=False)
    assert _our_ids(smollm2_dir, CONVERSATIONS[2], add_generation_prompt=False) == expected


@pytest.mark.parametrize("prefill", ["The capital of France is", "Paris "])
def test_continue_final_message_matches_transformers(smollm2_dir: str, prefill: str) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    expected = _reference_ids(smollm2_dir, messages, continue_final_message=True)
    assert _our_ids(smollm2_dir, messages, continue_final_message=True) == expected
    text = load_chat_template(smollm2_dir).render(messages, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n" + prefill)  # open: no <|im_end|> after it


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_tiny_checkpoint_prompt_ids_match_transformers(tiny_chat_dir: str, messages) -> None:
    expected = _reference_ids(tiny_chat_dir, messages, add_generation_prompt=True)
    ids = _our_ids(tiny_chat_dir, messages)
    assert ids == expected
    # The template writes BOS; the tokenizer's post-processor must not add a second one.
    bos_id = Tokenizer.from_model_dir(tiny_chat_dir).token_id(BOS_TOKEN)
    assert ids[0] == bos_id and ids.count(bos_id) == 1


def test_tiny_checkpoint_continue_final_message(tiny_chat_dir: str) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": "It is  "}]  # trimmed by the template
    expected = _reference_ids(tiny_chat_dir, messages, continue_final_message=True)
    assert _our_ids(tiny_chat_dir, messages, continue_final_message=True) == expected


def test_raise_exception_is_a_chat_template_error(tiny_chat_dir: str) -> None:
    template = load_chat_template(tiny_chat_dir)
    with pytest.raises(ChatTemplateError, match="unknown role tool: use system, user or assistant"):
        template.render([{"role": "tool", "content": "42"}])


# Jinja features chat templates use (Qwen's, Llama 3.1's, Mistral's ...), rendered both ways.
FEATURES_TEMPLATE = """
{%- set ns = namespace(count=0, last='') -%}
{%- for message in messages -%}
  {%- if message.role == 'skip' %}{% continue %}{% endif -%}
  {%- if loop.index > 3 %}{% break %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  [{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}]
  {{ message.content | tojson }}
{% endfor %}
{%- if tools %}tools: {{ tools | tojson(indent=2) }}{% endif %}
{{ dict(a=1, b=2) | tojson(sort_keys=True) }} count={{ ns.count }}
{%- if enable_thinking is defined and not enable_thinking %} no-think{% endif %}
{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}
<assistant>{% endif %}
"""


def test_jinja_features_render_like_transformers(tiny_chat_dir: str) -> None:
    messages = [
        {"role": "user", "content": "<b>bold</b> & 'é'", "name": "ann"},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "", "tool_calls": None},  # None keys are dropped
        {"role": "user", "content": "three"},
        {"role": "user", "content": "four: past the break"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    template = ChatTemplate(FEATURES_TEMPLATE, BOS_TOKEN, "<|eos|>")
    ours = template.render(messages, tools=tools, chat_template_kwargs={"enable_thinking": False})
    reference = _reference_text(
        tiny_chat_dir,
        messages,
        chat_template=FEATURES_TEMPLATE,
        tools=tools,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert ours == reference
    assert "\"<b>bold</b> & 'é'\"" in ours  # tojson: no HTML escaping, no \\u escapes


def test_render_errors_say_why() -> None:
    sandbox = ChatTemplate("{{ messages.append(1) }}", "", "")
    with pytest.raises(ChatTemplateError, match="chat template"):
        sandbox.render(QUESTION)  # the sandbox is immutable
    underscore = ChatTemplate("{% set ns = namespace(_x=1) %}", "", "")
    with pytest.raises(ChatTemplateError, match="underscore"):
        underscore.render(QUESTION)
    broken = ChatTemplate("{{ messages[0]['content'] + 1 }}", "", "")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        broken.render(QUESTION)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for %}", "", "").render(QUESTION)
    with pytest.raises(ChatTemplateError, match="must not set messages"):
        ChatTemplate("x", "", "").render(QUESTION, chat_template_kwargs={"messages": []})
    no_content = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}", "", "")
    with pytest.raises(ChatTemplateError, match="content"):
        no_content.render(QUESTION, continue_final_message=True)


def test_undefined_special_tokens_stay_undefined() -> None:
    template = ChatTemplate("{% if bos_token is defined %}bos{% else %}none{% endif %}", "", "")
    assert template.render(QUESTION) == "none"


# -- where the template comes from --------------------------------------------------------------


def _model_dir(path: Path, *, config: dict[str, Any] | None = None, jinja: str | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config or {}))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return str(path)


def test_lookup_order(tmp_path: Path) -> None:
    bos = {"content": "<s>", "special": True}  # an AddedToken dict, as older configs write it
    config = {"chat_template": "from-config", "bos_token": bos, "eos_token": "</s>"}
    model = _model_dir(tmp_path / "m", config=config)
    assert load_chat_template(model) == ChatTemplate("from-config", "<s>", "</s>")
    model = _model_dir(tmp_path / "m", config=config, jinja="from-jinja-file")
    assert load_chat_template(model).source == "from-jinja-file"
    override = tmp_path / "override.jinja"
    override.write_text("from-override")
    assert load_chat_template(model, str(override)).source == "from-override"
    assert load_chat_template(_model_dir(tmp_path / "none")) is None


def test_named_templates_take_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    model = _model_dir(tmp_path / "m", config={"chat_template": named})
    assert load_chat_template(model).source == "chat"
    model = _model_dir(tmp_path / "n", config={"chat_template": named[:1]})
    assert load_chat_template(model) is None


def test_special_tokens_map_fills_in(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", config={"chat_template": "t"})
    (tmp_path / "m" / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert load_chat_template(model) == ChatTemplate("t", "<s>", "")


def test_load_fails_on_bad_files(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    with pytest.raises(ChatTemplateError, match="cannot read"):
        load_chat_template(model, str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="syntax error, line 1"):
        load_chat_template(model, str(broken))


def test_generation_tag_renders_its_body() -> None:
    # transformers' {% generation %} marks assistant text for training masks; here it is text.
    template = ChatTemplate("{% generation %}{{ messages[0].content }}{% endgeneration %}", "", "")
    assert template.render(QUESTION) == QUESTION[0]["content"]

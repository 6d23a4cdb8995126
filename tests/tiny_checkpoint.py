"""A tiny random-weight Llama checkpoint for tests, in the Hugging Face directory layout.

``make_tiny_llama(path)`` writes ``config.json``, ``model.safetensors``, ``tokenizer.json``
(a byte-level BPE trained here on a few standard-library sources, with ``<|bos|>``/``<|eos|>``
special tokens; encoding prepends ``<|bos|>`` like Llama tokenizers do), ``tokenizer_config.json``
and ``generation_config.json``. Weights are random but seeded, and drawn with a wider spread
than transformers' default so that logits are peaked: greedy decoding then has clear winners
and does not flip on rounding differences between implementations.

``make_tiny_llama(path, chat_template=TINY_CHAT_TEMPLATE)`` also gives the checkpoint a chat
template (in ``tokenizer_config.json``, as Hub checkpoints have it); by default it has none.
``TINY_TOOLS_CHAT_TEMPLATE`` is one that renders ``tools`` (Hermes style).

``tiny_llama_dir(**kwargs)`` builds one checkpoint per distinct set of arguments per process
and reuses it (the directories are removed when the process exits); ``tiny_llama`` is the
matching session-scoped pytest fixture (import it into a test module to use it).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2

# A chat template in the style of Llama 3's: it writes BOS itself (so the prompt must be tokenized
# without adding special tokens again), closes every turn with EOS, and refuses unknown roles
# with raise_exception.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] | trim + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# TINY_CHAT_TEMPLATE with tools, in the Hermes / Qwen 2.5 style: the tools (as JSON) go into the
# system turn with how to call one, an assistant's calls are written as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks (the convention the gateway's
# parser reads back), and a "tool" turn carries the result in <tool_response>.
TINY_TOOLS_CHAT_TEMPLATE = """{{ bos_token }}
{%- if tools %}
{{- '<|system|>\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] | trim + '\n\n' }}{%- endif %}
{{- 'You may call one or more functions. Their signatures:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nTo call one, answer <tool_call>{"name": <name>, "arguments": <object>}</tool_call>'
    + eos_token + '\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|system|>\n' + messages[0]['content'] | trim + eos_token + '\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' and message.tool_calls is defined %}
{{- '<|assistant|>\n' }}
{%- if message.content %}{{- message.content | trim + '\n' }}{%- endif %}
{%- for call in message.tool_calls %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": '
    + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- eos_token + '\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|tool|>\n<tool_response id="' + message.tool_call_id | default('') + '">\n'
    + message['content'] + '\n</tool_response>' + eos_token + '\n' }}
{%- elif message['role'] in ['system', 'user', 'assistant'] %}
{{- '<|' + message['role'] + '|>\n' + message['content'] | trim + eos_token + '\n' }}
{%- else %}
{{- raise_exception('unknown role ' + message['role'] + ': use system, user, assistant or tool') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}
"""

# A few stdlib sources (~250 KB of English-ish Python): enough text for a few hundred merges.
_CORPUS_MODULES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py"]


def _corpus_files() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, name) for name in _CORPUS_MODULES]
    return [path for path in files if os.path.exists(path)]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_corpus_files(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _jitter_norms_and_biases(model) -> None:
    """transformers starts norm weights at 1 and biases at 0; jitter them so that a loader that
    skips them (or swaps them) fails the tests."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            if name.endswith(".bias") or (is_norm and name.endswith(".weight")):
                param.add_(torch.randn_like(param) * 0.1)


def _favour_token(model, token: str, tokenizer) -> None:
    """Give ``token`` a logit far above the others wherever it may come, as a trained model
    prefers the token that closes what it wrote: the residual stream's first dimension is a
    constant (every embedding's, no layer writes it) that only that token's LM head row reads."""
    import torch

    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, f"{token!r} is not one token"
    llama = model.model
    with torch.no_grad():
        llama.embed_tokens.weight[:, 0] = 1.0
        for layer in llama.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        llama.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[token_id, 0] = 1000.0


def _save_tiny(
    path: str,
    config_class: str,
    model_class: str,
    config: dict[str, Any],
    seed: int,
    model_max_length: int,
    chat_template: str | None = None,
    favoured_token: str | None = None,
) -> str:
    """Train the tokenizer, build ``transformers.<model_class>`` from ``<config_class>(**config)``
    (plus the special token ids) under ``seed``, and write the whole checkpoint directory
    (model, tokenizer, configs) at ``path``."""
    import torch
    import transformers
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    os.makedirs(path, exist_ok=True)
    tokenizer = _train_tokenizer(config["vocab_size"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    model_config = getattr(transformers, config_class)(
        **config, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(model_config)
        _jitter_norms_and_biases(model)
        if favoured_token is not None:
            _favour_token(model, favoured_token, tokenizer)
    model.save_pretrained(path)
    _write_json(
        os.path.join(path, "generation_config.json"),
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id},
    )
    _write_json(
        os.path.join(path, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "model_max_length": model_max_length,
            **({"chat_template": chat_template} if chat_template else {}),
        },
    )
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o644)
    return path


def make_tiny_llama(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    initializer_range: float = 0.25,
    chat_template: str | None = None,
    favoured_token: str | None = None,
) -> str:
    """Write a tiny seeded Llama checkpoint directory at ``path`` and return ``path``.

    ``rope_scaling`` is merged into transformers' ``rope_parameters`` (e.g. a ``llama3`` dict);
    ``chat_template`` goes into ``tokenizer_config.json`` (e.g. ``TINY_CHAT_TEMPLATE``);
    ``favoured_token`` (one token's text) is chosen wherever it is allowed.
    """
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters.update(rope_scaling)
    config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )
    return _save_tiny(
        path,
        "LlamaConfig",
        "LlamaForCausalLM",
        config,
        seed,
        max_position_embeddings,
        chat_template=chat_template,
        favoured_token=favoured_token,
    )


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


_cache_root: str | None = None
_built: dict[str, str] = {}


def _remove_cache_root() -> None:
    if _cache_root is not None:
        shutil.rmtree(_cache_root, ignore_errors=True)


def _build_once(name: str, key_source: Any, make: Callable[[str], str]) -> str:
    """``make(path)``'s checkpoint for ``key_source`` (JSON-able), built once per process."""
    global _cache_root
    key = hashlib.sha1(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:12]
    if key in _built:
        return _built[key]
    if _cache_root is None:
        _cache_root = tempfile.mkdtemp(prefix="switchboard-tiny-llama-")
        atexit.register(_remove_cache_root)
    path = os.path.join(_cache_root, f"{name}-{key}")
    building = path + ".partial"
    make(building)
    os.rename(building, path)  # readers never see a half-written checkpoint
    _built[key] = path
    return path


def tiny_llama_dir(**kwargs: Any) -> str:
    """The checkpoint ``make_tiny_llama(path, **kwargs)`` writes, built once per process."""
    return _build_once("tiny-llama", kwargs, lambda path: make_tiny_llama(path, **kwargs))


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    """Path of the default tiny Llama checkpoint (shared by the whole test session)."""
    return tiny_llama_dir()


# -- other families: Qwen2, Mistral, GPT-2 ---------------------------------------------------


def make_tiny_qwen2(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    max_window_layers: int = 1,
    initializer_range: float = 0.25,
) -> str:
    """A tiny seeded Qwen2 checkpoint (biases on q/k/v). ``sliding_window`` switches the
    window on (``use_sliding_window``) for layers ``max_window_layers`` and up."""
    config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=max_window_layers,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )
    return _save_tiny(
        path, "Qwen2Config", "Qwen2ForCausalLM", config, seed, max_position_embeddings
    )


def make_tiny_mistral(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    sliding_window: int | None = 12,
    initializer_range: float = 0.25,
) -> str:
    """A tiny seeded Mistral checkpoint; ``sliding_window`` (on every layer) defaults to fewer
    tokens than the test prompts so the window matters."""
    config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        sliding_window=sliding_window,
        initializer_range=initializer_range,
    )
    return _save_tiny(
        path, "MistralConfig", "MistralForCausalLM", config, seed, max_position_embeddings
    )


def make_tiny_gpt2(
    path: str,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    activation_function: str = "gelu_new",
    initializer_range: float = 0.25,
) -> str:
    """A tiny seeded GPT-2 checkpoint (learned positions, LayerNorm, fused Conv1D c_attn)."""
    config = dict(
        vocab_size=vocab_size,
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=num_heads,
        n_positions=max_position_embeddings,
        activation_function=activation_function,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )
    return _save_tiny(path, "GPT2Config", "GPT2LMHeadModel", config, seed, max_position_embeddings)


TINY_FAMILIES = {
    "llama": make_tiny_llama,
    "qwen2": make_tiny_qwen2,
    "mistral": make_tiny_mistral,
    "gpt2": make_tiny_gpt2,
}


def tiny_checkpoint_dir(family: str, **kwargs: Any) -> str:
    """The checkpoint ``TINY_FAMILIES[family](path, **kwargs)`` writes, built once per process."""
    if family == "llama":
        return tiny_llama_dir(**kwargs)
    make = TINY_FAMILIES[family]
    return _build_once(f"tiny-{family}", [family, kwargs], lambda path: make(path, **kwargs))

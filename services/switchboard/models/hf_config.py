"""Reading a Hugging Face ``config.json`` into the facts our model code needs.

Both config styles are accepted: transformers < 5 writes ``rope_theta`` at the top level and
an optional ``rope_scaling`` dict (keyed ``rope_type`` or, older still, ``type``);
transformers >= 5 writes one ``rope_parameters`` dict holding ``rope_theta`` and
``rope_type``. Where a file has both, ``rope_parameters`` wins.

GPT-2 configs name the same facts differently (``n_embd``, ``n_layer``, ``n_head``,
``n_positions``, ``n_inner``, ``layer_norm_epsilon``, ``activation_function``); they are read
through the Llama-style names. Defaults that ``save_pretrained`` leaves out of the file depend on
the model type (GPT-2 ties its embeddings by default, Qwen2 keeps its sliding window off).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# GPT-2 style key -> the Llama-style key it means.
_KEY_ALIASES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
    "n_inner": "intermediate_size",
    "layer_norm_epsilon": "layer_norm_eps",
    "activation_function": "hidden_act",
}
# Values a model type assumes when its config.json leaves the key out.
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"tie_word_embeddings": True, "hidden_act": "gelu_new"},
    "qwen2": {"use_sliding_window": False, "max_window_layers": 28},
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class TransformerConfig:
    """The architecture of one decoder-only checkpoint, whatever style its config.json uses."""

    architecture: str  # e.g. "LlamaForCausalLM": picks the model family
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    checkpoint_dtype: str | None = None  # "bfloat16", "float32", ... as the checkpoint says
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    layer_norm_eps: float = 1e-5  # LayerNorm families (GPT-2)
    sliding_window: int | None = None  # tokens a sliding-attention layer sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of this layer's attention, or None for full causal attention."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer_index] == SLIDING_ATTENTION else None


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}: not a Hugging Face checkpoint")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_transformer_config(model_dir: str) -> TransformerConfig:
    return parse_transformer_config(read_config_json(model_dir))


def parse_transformer_config(raw_config: dict[str, Any]) -> TransformerConfig:
    raw = _normalized(raw_config)
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    num_heads = raw["num_attention_heads"]
    hidden_size = raw["hidden_size"]
    num_layers = raw["num_hidden_layers"]
    max_positions = raw.get("max_position_embeddings", 2048)
    sliding_window, layer_types = parse_sliding_window(raw, num_layers)
    return TransformerConfig(
        architecture=architectures[0] if architectures else model_type,
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=raw.get("intermediate_size") or 4 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden_size // num_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope=parse_rope(raw, max_positions),
        hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        raw=raw_config,
        layer_norm_eps=raw.get("layer_norm_eps", 1e-5),
        sliding_window=sliding_window,
        layer_types=layer_types,
    )


def _normalized(raw: dict[str, Any]) -> dict[str, Any]:
    """Llama-style keys, and the model type's defaults for keys the file leaves out."""
    result = dict(_MODEL_TYPE_DEFAULTS.get(raw.get("model_type", ""), {}))
    for key, value in raw.items():
        result[_KEY_ALIASES.get(key, key)] = value
    return result


def parse_sliding_window(
    raw: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """``(window, layer types)`` following transformers: Qwen2 switches the window on with
    ``use_sliding_window`` for layers from ``max_window_layers`` on; Mistral uses it on every
    layer whenever ``sliding_window`` is set; an explicit ``layer_types`` list wins."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first_sliding = raw.get("max_window_layers", 0)
        layer_types = [
            SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
            for i in range(num_layers)
        ]
    unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown or len(layer_types) != num_layers:
        raise ValueError(
            f"unsupported layer_types {layer_types!r}: expected {num_layers} entries of "
            f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
        )
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return (int(window) if window is not None else None), tuple(layer_types)


def parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    params: dict[str, Any] = {"rope_theta": raw.get("rope_theta", 10000.0)}
    params.update(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(params["rope_theta"]),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_position_embeddings)
        ),
    )

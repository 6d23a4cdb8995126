"""Reading a Hugging Face ``config.json`` into the facts our model code needs.

Both config styles are accepted: transformers < 5 writes ``rope_theta`` at the top level and
an optional ``rope_scaling`` dict (keyed ``rope_type`` or, older still, ``type``);
transformers >= 5 writes one ``rope_parameters`` dict holding ``rope_theta`` and
``rope_type``. Where a file has both, ``rope_parameters`` wins.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}: not a Hugging Face checkpoint")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_transformer_config(model_dir: str) -> TransformerConfig:
    return parse_transformer_config(read_config_json(model_dir))


def parse_transformer_config(raw: dict[str, Any]) -> TransformerConfig:
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    num_heads = raw["num_attention_heads"]
    hidden_size = raw["hidden_size"]
    max_positions = raw.get("max_position_embeddings", 2048)
    return TransformerConfig(
        architecture=architectures[0] if architectures else model_type,
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
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
        raw=raw,
    )


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

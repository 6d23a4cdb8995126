"""config.json in both styles: transformers < 5 (rope_theta, rope_scaling) and >= 5
(rope_parameters)."""

from __future__ import annotations

import pytest

from switchboard.models.hf_config import RopeConfig, parse_rope, parse_transformer_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_defaults_fill_what_old_configs_leave_out():
    config = parse_transformer_config(BASE)
    assert config.num_kv_heads == 4  # no num_key_value_heads: plain multi-head attention
    assert config.head_dim == 16
    assert config.rope == RopeConfig(theta=10000.0, original_max_position_embeddings=256)
    assert not config.tie_word_embeddings and not config.attention_bias


def test_rope_theta_style_and_rope_parameters_style_agree():
    old = parse_rope(
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}, 256
    )
    new = parse_rope(
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}}, 256
    )
    assert old == new
    assert new.type == "llama3" and new.theta == 500000.0 and new.factor == 8.0
    assert new.original_max_position_embeddings == 8192


def test_oldest_style_names_the_rope_type_type():
    rope = parse_rope({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, 256)
    assert rope.type == "linear" and rope.factor == 2.0


def test_rope_parameters_win_over_top_level_rope_theta():
    rope = parse_rope({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 7.0}}, 256)
    assert rope.theta == 7.0 and rope.type == "default"


def test_unsupported_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="yarn"):
        parse_rope({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 256)


def test_checkpoint_dtype_read_from_either_key():
    assert parse_transformer_config({**BASE, "torch_dtype": "bfloat16"}).checkpoint_dtype == (
        "bfloat16"
    )
    assert parse_transformer_config({**BASE, "dtype": "float16"}).checkpoint_dtype == "float16"

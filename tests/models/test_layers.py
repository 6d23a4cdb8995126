"""Layers against the transformers implementation they must reproduce."""

from __future__ import annotations

import math

import torch

from switchboard.models.hf_config import RopeConfig
from switchboard.models.layers import (
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rope_inverse_frequencies,
)


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    ours = rope_inverse_frequencies(
        RopeConfig(
            theta=500000.0,
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        head_dim=128,
    )
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)
    plain = rope_inverse_frequencies(RopeConfig(theta=500000.0), head_dim=128)
    assert not torch.allclose(ours, plain)  # the scaling did something


def test_rotary_rotates_pairs_by_position_times_frequency():
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim=4, device="cpu", max_positions=8)
    positions = torch.tensor([0, 3])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).expand(2, 1, 4)  # [tokens, heads, dim]
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated[0, 0], x[0, 0])  # position 0: unchanged
    angle = 3 * 1.0  # first pair's frequency is theta**0 = 1
    torch.testing.assert_close(
        rotated[1, 0], torch.tensor([math.cos(angle), 0, math.sin(angle), 0])
    )


def test_rotary_tables_are_what_one_position_computes_alone():
    """The tables are computed on the calling thread: every position's cosines and sines are
    those of a tensor of that position alone (torch splits a large one across its threads,
    whose results differed in some processes), and torch's thread count is left as it was."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rotary = RotaryEmbedding(
            RopeConfig(theta=10000.0), head_dim=16, device="cpu", max_positions=1024
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    for position in (0, 1, 255, 256, 700, 1023):
        angles = torch.tensor(float(position)) * rotary.inv_freq
        assert torch.equal(rotary.cos_table[position], angles.cos())
        assert torch.equal(rotary.sin_table[position], angles.sin())


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 32)
    ours, theirs = RMSNorm(32, eps=1e-5), LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        weight = torch.randn(32)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    torch.testing.assert_close(ours(x), theirs(x))


def test_merged_linear_equals_its_parts():
    torch.manual_seed(0)
    parts = {"a": torch.nn.Linear(8, 3), "b": torch.nn.Linear(8, 5)}
    merged = MergedLinear(8, {"a": 3, "b": 5}, bias=True)
    for name, part in parts.items():
        merged.load_shard(name, "weight", part.weight)
        merged.load_shard(name, "bias", part.bias)
    x = torch.randn(4, 8)
    a, b = merged.split(merged(x))
    torch.testing.assert_close(a, parts["a"](x))
    torch.testing.assert_close(b, parts["b"](x))

"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameters keep Hugging Face's names except two fused layers: ``qkv_proj`` holds
``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` holds ``gate_proj``/``up_proj``
(one matmul instead of three or two). ``load_weights`` maps checkpoint names onto them.

Qwen2 and Mistral are this architecture with other attention choices (biases, sliding
window); their families subclass :class:`LlamaForCausalLM` and override
:meth:`LlamaForCausalLM.attention_layout`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from switchboard.models.attention import AttentionMetadata, paged_attention
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    apply_rotary,
    silu_and_mul,
)
from switchboard.models.weights import LLAMA_STACKED_MODULES, load_named_weights

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class AttentionLayout:
    """The choices that differ between Llama-style families, per layer."""

    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # None = full causal attention


class LlamaAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layout: AttentionLayout) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = layout.sliding_window
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=layout.qkv_bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=layout.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        query = apply_rotary(query.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        key = apply_rotary(key.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        attended = paged_attention(
            query, key, value, kv_cache, metadata, self.scale, self.sliding_window
        )
        return self.o_proj(attended)


class LlamaMLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act 'silu', not {config.hidden_act!r}")
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": size, "up": size}, bias=config.mlp_bias
        )
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, layout: AttentionLayout) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: TransformerConfig, layouts: list[AttentionLayout]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, layout) for layout in layouts)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` maps this step's flattened tokens to final hidden states."""

    def __init__(self, config: TransformerConfig, device: torch.device | str) -> None:
        """Build under ``torch.device(device)`` and the target default dtype: parameters are
        allocated (uninitialised) where they will live, then filled by ``load_weights``."""
        super().__init__()
        self.config = config
        layouts = [self.attention_layout(config, i) for i in range(config.num_layers)]
        self.model = LlamaModel(config, layouts)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        # Tied embeddings: the output projection reuses embed_tokens.weight, so there is
        # no lm_head parameter at all (and a checkpoint's copy of it is ignored).
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def attention_layout(cls, config: TransformerConfig, layer_index: int) -> AttentionLayout:
        """Llama: one ``attention_bias`` switch for all four projections."""
        return AttentionLayout(
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            sliding_window=config.layer_sliding_window(layer_index),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` for the given final hidden states."""
        weight = self.lm_head.weight if self.lm_head else self.model.embed_tokens.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the parameter names filled."""
        return load_named_weights(self, self._checkpoint_tensors(weights), LLAMA_STACKED_MODULES)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue  # a tied checkpoint's copy of the embedding matrix
            yield name, tensor

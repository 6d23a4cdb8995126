"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameters keep Hugging Face's names except two fused layers: ``qkv_proj`` holds
``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` holds ``gate_proj``/``up_proj``
(one matmul instead of three or two). ``load_weights`` maps checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

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

# checkpoint module name -> (our fused module name, shard name)
_STACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.attention_bias)

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
        attended = paged_attention(query, key, value, kv_cache, metadata, self.scale)
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
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
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
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward`` maps this step's flattened tokens to final hidden states."""

    def __init__(self, config: TransformerConfig, device: torch.device | str) -> None:
        """Build under ``torch.device(device)`` and the target default dtype: parameters are
        allocated (uninitialised) where they will live, then filled by ``load_weights``."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        # Tied embeddings: the output projection reuses embed_tokens.weight, so there is
        # no lm_head parameter at all (and a checkpoint's copy of it is ignored).
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

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
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, module_name = module_path.rpartition(".")
            if module_name in _STACKED_MODULES:
                fused_name, shard = _STACKED_MODULES[module_name]
                fused_path = f"{parent}.{fused_name}"
                modules[fused_path].load_shard(shard, param_name, tensor)
                loaded.add(f"{fused_path}.{param_name}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model shape {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return _collapse_shards(loaded, modules)


def _collapse_shards(loaded: set[str], modules: dict[str, nn.Module]) -> set[str]:
    """Count a fused parameter as loaded once every one of its shards was."""
    result = {name for name in loaded if "#" not in name}
    shards_seen: dict[str, set[str]] = {}
    for name in loaded - result:
        param_path, shard = name.split("#")
        shards_seen.setdefault(param_path, set()).add(shard)
    for param_path, shards in shards_seen.items():
        module = modules[param_path.rpartition(".")[0]]
        if shards == set(module.shard_sizes):
            result.add(param_path)
    return result

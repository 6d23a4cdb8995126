"""The BERT family (encoders such as all-MiniLM-L6-v2): bidirectional attention, post-LN, GELU.

An encoder has no KV cache: each sequence is computed whole, in one forward pass, and every
token attends to every other token of its own sequence. The sequences of one step are
flattened into ``[num_tokens, hidden]`` like the decoders' batches; ``seq_lens`` says where
each one ends, and attention runs per sequence::

    embeddings = LayerNorm(word[token] + position[p] + token_type[type])
    each layer: x = LayerNorm(x + Attention(x));  x = LayerNorm(x + W2 GELU(W1 x))

Parameters keep Hugging Face's ``BertModel`` names except ``attention.qkv_proj``, which holds
``attention.self.query/key/value`` (one matmul instead of three). BERT's ``pooler`` (a dense
layer over [CLS] for next-sentence prediction) is not part of an embedding and is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from switchboard.models.hf_config import TransformerConfig
from switchboard.models.layers import Linear, MergedLinear, VocabEmbedding

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# checkpoint "<...>.attention.self.<name>" -> shard of our "<...>.attention.qkv_proj"
_QKV_SHARDS = {"query": "q", "key": "k", "value": "v"}
_SKIPPED_PREFIXES = ("pooler.", "cls.")  # next-sentence / masked-LM heads
_SKIPPED_SUFFIXES = ("position_ids",)  # a buffer some checkpoints store


class BertEmbeddings(nn.Module):
    def __init__(self, config: TransformerConfig, eps: float) -> None:
        super().__init__()
        type_vocab_size = int(config.raw.get("type_vocab_size", 2))
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = VocabEmbedding(
            config.max_position_embeddings, config.hidden_size
        )
        self.token_type_embeddings = VocabEmbedding(type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        embedded = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(embedded)


class BertDenseNorm(nn.Module):
    """``LayerNorm(residual + dense(x))``: the post-LN output of a sub-layer."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertAttention(nn.Module):
    def __init__(self, config: TransformerConfig, eps: float) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        size = config.hidden_size
        self.qkv_proj = MergedLinear(size, {"q": size, "k": size, "v": size}, bias=True)
        self.output = BertDenseNorm(size, size, eps)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        query, key, value = (t.reshape(shape) for t in self.qkv_proj.split(self.qkv_proj(hidden)))
        attended = torch.empty_like(query)
        start = 0
        for length in seq_lens:  # every token sees its whole sequence and nothing else
            rows = slice(start, start + length)
            q, k, v = (t[rows].transpose(0, 1)[None] for t in (query, key, value))
            attended[rows] = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
            start += length
        return self.output(attended.reshape(num_tokens, -1), hidden)


class BertLayer(nn.Module):
    def __init__(self, config: TransformerConfig, eps: float) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {config.hidden_act!r} is not supported")
        self.activation = _ACTIVATIONS[config.hidden_act]
        self.attention = BertAttention(config, eps)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config.intermediate_size, config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        hidden = self.attention(hidden, seq_lens)
        return self.output(self.activation(self.intermediate.dense(hidden)), hidden)


class BertIntermediate(nn.Module):
    """The up-projection of a layer's MLP (a module of its own: the checkpoint names it so)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)


class BertEncoder(nn.Module):
    def __init__(self, config: TransformerConfig, eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, eps) for _ in range(config.num_layers))


class BertModel(nn.Module):
    """``forward`` maps the flattened tokens of whole sequences to final hidden states."""

    def __init__(self, config: TransformerConfig, device: torch.device | str) -> None:
        """Build under ``torch.device(device)`` and the target default dtype (see loader)."""
        super().__init__()
        position_type = config.raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"BERT position_embedding_type {position_type!r} is not supported")
        eps = float(config.raw.get("layer_norm_eps", 1e-12))
        self.config = config
        self.embeddings = BertEmbeddings(config, eps)
        self.encoder = BertEncoder(config, eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor,
        seq_lens: list[int],
    ) -> torch.Tensor:
        """``input_ids``/``positions``/``token_type_ids`` are ``[num_tokens]``, the sequences
        back to back; ``sum(seq_lens) == num_tokens``. Returns ``[num_tokens, hidden]``."""
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, seq_lens)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        qkv_shards: dict[str, set[str]] = {}
        for raw_name, tensor in weights:
            name = _our_name(raw_name)
            if name.startswith(_SKIPPED_PREFIXES) or name.endswith(_SKIPPED_SUFFIXES):
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, module_name = module_path.rpartition(".")
            if parent.endswith(".attention.self") and module_name in _QKV_SHARDS:
                fused_path = parent.removesuffix(".self") + ".qkv_proj"
                modules[fused_path].load_shard(_QKV_SHARDS[module_name], param_name, tensor)
                param_path = f"{fused_path}.{param_name}"
                qkv_shards.setdefault(param_path, set()).add(module_name)
                if len(qkv_shards[param_path]) == len(_QKV_SHARDS):
                    loaded.add(param_path)
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {raw_name!r} has no place in BertModel")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{raw_name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model shape {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded


def _our_name(name: str) -> str:
    """Checkpoint name -> parameter name: drop a task model's ``bert.`` prefix and map the
    old TensorFlow-style ``gamma``/``beta`` of LayerNorm to ``weight``/``bias``."""
    name = name.removeprefix("bert.")
    if name.endswith(".gamma"):
        return name.removesuffix(".gamma") + ".weight"
    if name.endswith(".beta"):
        return name.removesuffix(".beta") + ".bias"
    return name

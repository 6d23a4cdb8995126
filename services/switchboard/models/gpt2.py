"""The GPT-2 family: learned absolute positions, LayerNorm before each block, GELU MLP, and
multi-head attention whose query, key and value come from one fused ``c_attn`` projection.

Parameters keep Hugging Face's names (``transformer.wte``, ``transformer.h.<i>.attn.c_attn`` …).
Checkpoints store GPT-2's projections as ``Conv1D`` weights, ``[in, out]``; ``load_weights``
transposes them into our ``[out, in]`` linears and splits ``c_attn`` into its q/k/v shards (so a
tensor-parallel linear can take its slice of each). Old checkpoints without the
``transformer.`` prefix load too; their causal-mask buffers (``attn.bias``,
``attn.masked_bias``) are not weights and are skipped. The output projection is tied to
``wte`` unless ``tie_word_embeddings`` is false.

Parallelism as in ``llama.py``: column-parallel ``c_attn``/``c_fc``, row-parallel ``c_proj``s,
a vocabulary-parallel ``wte`` and LM head; ``wpe`` is replicated on the first stage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from switchboard.models.attention import AttentionMetadata, paged_attention
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.layers import LayerNorm, PositionEmbedding, activation
from switchboard.models.parallel import SINGLE_PROCESS, ParallelState
from switchboard.models.parallel_layers import (
    ColumnParallelLinear,
    MissingLayer,
    RowParallelLinear,
    VocabParallelEmbedding,
    previous_stage_hidden,
    stage_layer_list,
    stage_lm_head,
    vocab_parallel_logits,
)
from switchboard.models.weights import load_named_weights, with_tied_lm_head

_PREFIX = "transformer."
_CONV1D_MODULES = ("c_attn", "c_proj", "c_fc")
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# The split parts of c_attn -> (fused module, shard); see ``_checkpoint_tensors``.
_STACKED_MODULES = {
    "q_proj": ("c_attn", "q"),
    "k_proj": ("c_attn", "k"),
    "v_proj": ("c_attn", "v"),
}


class GPT2Attention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_index: int, parallel: ParallelState):
        super().__init__()
        hidden = config.hidden_size
        heads = parallel.split(config.num_heads, "the number of attention heads")
        self.num_heads = heads.size  # this TP rank's
        self.head_dim = hidden // config.num_heads
        self.scale = self.head_dim**-0.5 if config.raw.get("scale_attn_weights", True) else 1.0
        if config.raw.get("scale_attn_by_inverse_layer_idx", False):
            self.scale /= float(layer_index + 1)
        rows = heads.scaled(self.head_dim)
        self.c_attn = ColumnParallelLinear(hidden, {"q": rows, "k": rows, "v": rows}, bias=True)
        self.c_proj = RowParallelLinear(rows, hidden, bias=True, parallel=parallel)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        shape = (hidden.shape[0], self.num_heads, self.head_dim)
        query, key, value = (part.view(shape) for part in self.c_attn.split(self.c_attn(hidden)))
        return self.c_proj(paged_attention(query, key, value, kv_cache, metadata, self.scale))


class GPT2MLP(nn.Module):
    def __init__(self, config: TransformerConfig, parallel: ParallelState) -> None:
        super().__init__()
        columns = parallel.split(config.intermediate_size, "the MLP intermediate size")
        self.c_fc = ColumnParallelLinear(config.hidden_size, {"fc": columns}, bias=True)
        self.act = activation(config.hidden_act)
        self.c_proj = RowParallelLinear(columns, config.hidden_size, bias=True, parallel=parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(hidden)))


class GPT2Block(nn.Module):
    def __init__(self, config: TransformerConfig, layer_index: int, parallel: ParallelState):
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.attn = GPT2Attention(config, layer_index, parallel)
        self.ln_2 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = GPT2MLP(config, parallel)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: TransformerConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.wte: nn.Module = MissingLayer()
        self.wpe: nn.Module = MissingLayer()
        if parallel.is_first_stage:
            self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
            self.wpe = PositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h, self.stage_blocks = stage_layer_list(
            config.num_layers, parallel, lambda i: GPT2Block(config, i, parallel)
        )
        self.ln_f: nn.Module = MissingLayer()
        if parallel.is_last_stage:
            self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_eps)


class GPT2LMHeadModel(nn.Module):
    """``forward`` maps this step's flattened tokens to final hidden states (on a pipeline
    stage other than the last: to the hidden states its blocks hand on)."""

    supports_parallel = True

    def __init__(
        self,
        config: TransformerConfig,
        device: torch.device | str,
        parallel: ParallelState = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        if config.raw.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder) is not supported")
        if config.hidden_size % config.num_heads:
            raise ValueError(
                f"hidden size {config.hidden_size} is not divisible by {config.num_heads} heads"
            )
        self.config = config
        self.parallel = parallel
        self.transformer = GPT2Model(config, parallel)
        # Tied (the default): the output projection is wte, unless wte is on another stage.
        self.lm_head = stage_lm_head(config, parallel)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_caches``: one per block of this stage. ``intermediate``: on a stage other than
        the first, the hidden states the previous stage handed on."""
        if self.parallel.is_first_stage:
            hidden = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        else:
            hidden = previous_stage_hidden(intermediate)
        for block, kv_cache in zip(self.transformer.stage_blocks, kv_caches, strict=True):
            hidden = block(hidden, kv_cache, metadata)
        return self.transformer.ln_f(hidden) if self.parallel.is_last_stage else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` for the given final hidden states (last stage;
        a collective over the TP ranks)."""
        head = self.logits_head()
        return vocab_parallel_logits(
            hidden, head.logits_weight(), self.parallel, self.config.vocab_size, head.small_batch
        )

    def logits_head(self) -> VocabParallelEmbedding:
        """The module whose matrix computes the logits: the LM head, or the embedding it is
        tied to (last stage only)."""
        head = self.lm_head if self.lm_head is not None else self.transformer.wte
        if not isinstance(head, VocabParallelEmbedding):
            raise RuntimeError("only the last pipeline stage computes logits")
        return head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the parameter names filled."""
        return load_named_weights(self, self._checkpoint_tensors(weights), _STACKED_MODULES)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint tensors renamed, transposed and split into this model's layout."""
        tied = self.config.tie_word_embeddings
        prefixed = (  # old checkpoints name their tensors without "transformer."
            (name if name.startswith(("lm_head.", _PREFIX)) else _PREFIX + name, tensor)
            for name, tensor in weights
        )
        for name, tensor in with_tied_lm_head(prefixed, tied, self.lm_head, _PREFIX + "wte.weight"):
            if name.endswith(_MASK_BUFFERS):
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, module_name = module_path.rpartition(".")
            if module_name not in _CONV1D_MODULES:
                yield name, tensor
                continue
            if param_name == "weight":
                tensor = tensor.t()
            if module_name != "c_attn":
                yield name, tensor
                continue
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3), strict=True):
                yield f"{parent}.{part}.{param_name}", piece

"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameters keep Hugging Face's names except two fused layers: ``qkv_proj`` holds
``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` holds ``gate_proj``/``up_proj``
(one matmul instead of three or two). ``load_weights`` maps checkpoint names onto them.

Qwen2 and Mistral are this architecture with other attention choices (biases, sliding
window); their families subclass :class:`LlamaForCausalLM` and override
:meth:`LlamaForCausalLM.attention_layout`.

Parallelism (``models/parallel.py``): the projections are column/row-parallel, so a TP rank
holds its query heads, its KV heads and its MLP columns; a pipeline stage builds only its own
layers (the others are :class:`MissingLayer`), the embedding only on the first stage and the
final norm and LM head only on the last. A tied LM head on a last stage that is not also the
first gets its own copy of the embedding matrix.

On CPU a decode-only step may run all the layers in one C call instead of the loop over them
(``kernels/decode_stack.py``): the model hands its layers over as the stack's records
(``decode_stack_layers``) and keeps the stack's plan (``_decode_stack``). Where its caller
takes the logits of every row of a decode step (``logits_with_decodes``: the worker's model,
not a draft), such a step's call ends with the final norm and the LM head too, and
``compute_logits`` hands back those logits for the hidden states ``forward`` returned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from switchboard.kernels import decode_stack, fused_ops
from switchboard.kernels.decode_stack import StackLayer, StackMatmul
from switchboard.models.attention import AttentionMetadata, paged_attention
from switchboard.models.cpu_kernel_attention import CpuKernelBackend, stack_rows
from switchboard.models.hf_config import TransformerConfig
from switchboard.models.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul
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
from switchboard.models.weights import (
    LLAMA_STACKED_MODULES,
    load_named_weights,
    with_tied_lm_head,
)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class AttentionLayout:
    """The choices that differ between Llama-style families, per layer."""

    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # None = full causal attention


class LlamaAttention(nn.Module):
    def __init__(
        self, config: TransformerConfig, layout: AttentionLayout, parallel: ParallelState
    ) -> None:
        super().__init__()
        heads = parallel.split(config.num_heads, "the number of attention heads")
        kv_heads = parallel.kv_head_shard(config.num_kv_heads)
        self.num_heads = heads.size  # this TP rank's
        self.num_kv_heads = kv_heads.size
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = layout.sliding_window
        q_rows, kv_rows = heads.scaled(self.head_dim), kv_heads.scaled(self.head_dim)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, {"q": q_rows, "k": kv_rows, "v": kv_rows}, bias=layout.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            q_rows, config.hidden_size, bias=layout.o_bias, parallel=parallel
        )

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
    def __init__(self, config: TransformerConfig, parallel: ParallelState) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act 'silu', not {config.hidden_act!r}")
        columns = parallel.split(config.intermediate_size, "the MLP intermediate size")
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate": columns, "up": columns}, bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            columns, config.hidden_size, bias=config.mlp_bias, parallel=parallel
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: TransformerConfig, layout: AttentionLayout, parallel: ParallelState
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layout, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, parallel)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        hidden = fused_ops.add(hidden, attended)
        return fused_ops.add(hidden, self.mlp(self.post_attention_layernorm(hidden)))

    def stack_layer(self) -> StackLayer | None:
        """This layer as the one-call decode stack reads it; None while a matrix has no
        small-batch panels (weights not packed, or the kernel not in use). The stack computes in
        float32: a bfloat16 model's norms and biases are handed over as float32 copies."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        matmuls = []
        for projection in projections:
            if projection.small_batch is None:
                return None
            bias = None if projection.bias is None else _float32(projection.bias)
            matmuls.append(StackMatmul(projection.small_batch, bias))
        qkv, o, gate_up, down = matmuls
        return StackLayer(
            input_norm=_float32(self.input_layernorm.weight),
            input_norm_eps=self.input_layernorm.eps,
            qkv=qkv,
            o=o,
            post_attention_norm=_float32(self.post_attention_layernorm.weight),
            post_attention_norm_eps=self.post_attention_layernorm.eps,
            gate_up=gate_up,
            down=down,
            heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            scale=attn.scale,
            sliding_window=attn.sliding_window,
        )


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when float32, else a float32 copy (detached)."""
    return tensor.detach().to(torch.float32).contiguous()


class LlamaModel(nn.Module):
    def __init__(
        self, config: TransformerConfig, layouts: list[AttentionLayout], parallel: ParallelState
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = MissingLayer()
        if parallel.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel
            )
        self.layers, self.stage_layers = stage_layer_list(
            config.num_layers, parallel, lambda i: LlamaDecoderLayer(config, layouts[i], parallel)
        )
        self.norm: nn.Module = MissingLayer()
        if parallel.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class _DecodeLogits:
    """The logits the one-call stack computed with a step, and the hidden states ``forward``
    returned with them (held apart from the module: an ``nn.Module`` attribute write costs
    several microseconds of checks, twice a step)."""

    __slots__ = ("hidden", "logits")

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def forget(self) -> None:
        self.hidden = self.logits = None


class LlamaForCausalLM(nn.Module):
    """``forward`` maps this step's flattened tokens to final hidden states (on a pipeline
    stage other than the last: to the hidden states its layers hand on)."""

    supports_parallel = True

    def __init__(
        self,
        config: TransformerConfig,
        device: torch.device | str,
        parallel: ParallelState = SINGLE_PROCESS,
    ) -> None:
        """Build under ``torch.device(device)`` and the target default dtype: parameters are
        allocated (uninitialised) where they will live, then filled by ``load_weights``."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        layouts = [self.attention_layout(config, i) for i in range(config.num_layers)]
        self.model = LlamaModel(config, layouts, parallel)
        self.rotary = RotaryEmbedding(
            config.rope, config.head_dim, device, config.max_position_embeddings
        )
        # Tied embeddings: the output projection reuses embed_tokens.weight, so there is
        # no lm_head parameter at all (and a checkpoint's copy of it is ignored) -- unless the
        # embedding lives on another pipeline stage.
        self.lm_head = stage_lm_head(config, parallel)
        self._decode_stack = decode_stack.DecodeStack()
        # set by a caller that computes the logits of every row of each decode-only step, right
        # after ``forward``: the stack may compute them in the same call
        self.logits_with_decodes = False
        self._stack_head: decode_stack.StackHead | None = None
        self._stack_head_known = False
        self._decode_logits = _DecodeLogits()

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
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_caches``: one per layer of this stage. ``intermediate``: on a stage other than
        the first, the hidden states the previous stage handed on."""
        if self.parallel.is_first_stage:
            hidden = self.model.embed_tokens(input_ids)
        else:
            hidden = previous_stage_hidden(intermediate)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        self._decode_logits.forget()
        head = self._head_in_stack(hidden, metadata)
        logits = None if head is None else hidden.new_empty(hidden.shape[0], head.columns)
        if self._decode_in_one_call(hidden, cos, sin, kv_caches, metadata, head, logits):
            if logits is not None:  # the call normed ``hidden`` and computed its logits
                self._decode_logits.hidden, self._decode_logits.logits = hidden, logits
                return hidden
        else:
            for layer, kv_cache in zip(self.model.stage_layers, kv_caches, strict=True):
                hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return self.model.norm(hidden) if self.parallel.is_last_stage else hidden

    def _head_in_stack(
        self, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> decode_stack.StackHead | None:
        """The final norm and LM head for the one-call stack, on a float32 step of decodes
        only (every row sampled) whose caller takes its logits; None otherwise."""
        if (
            not self.logits_with_decodes
            or metadata.decode is None
            or metadata.prefills
            or metadata.lora is not None
            or hidden.dtype != torch.float32
        ):
            return None
        if not self._stack_head_known:  # the panels are made after loading, before serving
            self._stack_head_known = True
            if self.parallel.world_size == 1 and isinstance(self.model.norm, RMSNorm):
                head = self.logits_head()
                self._stack_head = decode_stack.stack_head(
                    self.model.norm.weight,
                    self.model.norm.eps,
                    head.logits_weight(),
                    head.small_batch,
                )
        return self._stack_head

    def _decode_in_one_call(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        head: decode_stack.StackHead | None = None,
        logits: torch.Tensor | None = None,
    ) -> bool:
        """A step on the CPU kernel backend: every layer in one C call, ``hidden`` in place
        (with ``head``: normed, and its logits into ``logits``).
        Decodes, and the chunks the decode-attention kernel attends (a decode with its proposed
        tokens, a short prompt), each token a row that sees the keys up to its own position.
        False where the stack does not apply (the caller loops over the layers): also a step
        with LoRA rows whose deltas the stack cannot add (they are the projections' hooks',
        which it does not run)."""
        decode = metadata.decode
        lora = metadata.lora
        if lora is not None and lora.stack is None:
            return False
        if not isinstance(metadata.backend, CpuKernelBackend):
            return False
        if metadata.prefills:
            rows = stack_rows(metadata, hidden.shape[0])
            if rows is None:
                return False
            block_table, context_lens = rows
        elif decode is not None:
            block_table, context_lens = decode.block_table, decode.context_lens
        else:
            return False
        return self._decode_stack.run(
            self.decode_stack_layers,
            hidden,
            cos,
            sin,
            kv_caches,
            metadata.slot_mapping,
            block_table,
            context_lens,
            None if lora is None else lora.stack,
            head,
            logits,
        )

    def decode_stack_layers(self) -> list[StackLayer] | None:
        """This stage's layers as the one-call decode stack reads them; None where it cannot run
        them: one process only (no tensor or pipeline parallelism), every layer a
        :class:`LlamaDecoderLayer` with its matrices' small-batch panels."""
        if self.parallel.world_size != 1:
            return None
        layers = []
        for layer in self.model.stage_layers:
            stacked = layer.stack_layer() if isinstance(layer, LlamaDecoderLayer) else None
            if stacked is None:
                return None
            layers.append(stacked)
        return layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` for the given final hidden states (last stage;
        a collective over the TP ranks). The hidden states ``forward`` just returned from a
        step whose call computed their logits: those."""
        computed = self._decode_logits
        logits = computed.logits if computed.hidden is hidden else None
        computed.forget()
        if logits is not None:
            return logits
        head = self.logits_head()
        return vocab_parallel_logits(
            hidden, head.logits_weight(), self.parallel, self.config.vocab_size, head.small_batch
        )

    def logits_head(self) -> VocabParallelEmbedding:
        """The module whose matrix computes the logits: the LM head, or the embedding it is
        tied to (last stage only)."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        if not isinstance(head, VocabParallelEmbedding):
            raise RuntimeError("only the last pipeline stage computes logits")
        return head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the parameter names filled."""
        return load_named_weights(self, self._checkpoint_tensors(weights), LLAMA_STACKED_MODULES)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        tied = self.config.tie_word_embeddings
        embedding = "model.embed_tokens.weight"
        for name, tensor in with_tied_lm_head(weights, tied, self.lm_head, embedding):
            if not name.endswith(_IGNORED_SUFFIXES):
                yield name, tensor

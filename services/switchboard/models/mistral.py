"""The Mistral family: Llama's architecture without biases, with a sliding window on every
layer when config.json sets ``sliding_window`` (Mistral 7B v0.1: 4096; null from v0.2 on).

The window is applied exactly (each query sees its last ``sliding_window`` positions, itself
included, as in transformers), so sequences longer than the window are served correctly; the
KV blocks behind the window are not freed early.
"""

from __future__ import annotations

from switchboard.models.hf_config import TransformerConfig
from switchboard.models.llama import AttentionLayout, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_layout(cls, config: TransformerConfig, layer_index: int) -> AttentionLayout:
        # Every layer, like transformers' MistralModel (which ignores a ``layer_types`` list).
        return AttentionLayout(sliding_window=config.sliding_window)

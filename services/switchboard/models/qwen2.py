"""The Qwen2 family: Llama's architecture with biases on the query, key and value projections
(never on the output projection), and an optional sliding window on the upper layers.

transformers' rule, followed here: ``use_sliding_window`` switches the window on for layers
``max_window_layers`` and up (or as an explicit ``layer_types`` says); see ``hf_config``.
"""

from __future__ import annotations

from switchboard.models.hf_config import TransformerConfig
from switchboard.models.llama import AttentionLayout, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_layout(cls, config: TransformerConfig, layer_index: int) -> AttentionLayout:
        return AttentionLayout(
            qkv_bias=True,
            o_bias=False,
            sliding_window=config.layer_sliding_window(layer_index),
        )

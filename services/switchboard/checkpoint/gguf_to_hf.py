"""Convert a Llama-architecture GGUF file into a Hugging Face checkpoint directory.

What comes out is what `transformers` would save for `LlamaForCausalLM`:

    config.json             architecture facts from the `llama.*` metadata keys
    generation_config.json  bos/eos/pad ids
    model.safetensors       every tensor dequantized to float32, under HF names
    gguf_blocks.safetensors the block-quantized matrices' raw GGUF blocks (gguf_blocks.py)
    tokenizer.json          rebuilt from `tokenizer.ggml.*` (see gguf_tokenizer.py)
    tokenizer_config.json   special tokens and the chat template

Two things llama.cpp's converter (convert_hf_to_gguf.py) did to the weights are undone here:
- GGUF lists a tensor's dims fastest-first (the reverse of numpy); the reader's arrays are
  already in numpy order, [out_features, in_features] like a torch Linear weight.
- The rows of Q and K were permuted per head from HF's "rotate half" rotary layout to GGML's
  interleaved-pairs layout; `unpermute_rotary_rows` puts them back.

float32 rather than bfloat16: a dequantized Q4_1 value (fp16 scale x 4-bit int + fp16 min) is
exact in float32 and not in bfloat16, and numpy has no bfloat16 to hand to safetensors. The
135M-parameter default model is ~540 MB this way; the worker casts to its --dtype on load.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from switchboard.checkpoint.gguf_blocks import GgufBlocks, write_gguf_blocks
from switchboard.checkpoint.gguf_fields import arch_field, field
from switchboard.checkpoint.gguf_tokenizer import special_token_ids, write_tokenizer_files
from switchboard.checkpoint.progress import Progress

log = logging.getLogger(__name__)

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write the HF checkpoint files for `gguf_path` into the existing directory `out_dir`.

    Returns the config.json contents. Writes into `out_dir` directly: the caller builds into a
    temporary directory and renames it, so a half-written checkpoint is never seen.
    """
    started = time.monotonic()
    reader = GGUFReader(gguf_path)
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: only llama-architecture GGUF is supported, not {arch!r}")
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = build_config(reader, tied="output.weight" not in tensor_names)
    log.info(
        "converting %s (%d tensors, %d layers) into %s",
        gguf_path.name,
        len(reader.tensors),
        config["num_hidden_layers"],
        out_dir,
    )

    tensors, blocks = _convert_tensors(reader, config)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_gguf_blocks(out_dir, blocks)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {**special_token_ids(reader)})
    write_tokenizer_files(reader, out_dir, model_max_length=config["max_position_embeddings"])
    log.info(
        "converted %s: %d tensors, %.1f M parameters, in %.1f s",
        gguf_path.name,
        len(tensors),
        sum(t.size for t in tensors.values()) / 1e6,
        time.monotonic() - started,
    )
    return config


def build_config(reader: GGUFReader, tied: bool) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from the `llama.*` metadata keys."""
    hidden_size = int(arch_field(reader, "embedding_length"))
    num_heads = int(arch_field(reader, "attention.head_count"))
    head_dim = int(arch_field(reader, "attention.key_length", hidden_size // num_heads))
    rotary_dim = int(arch_field(reader, "rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
    scaling = arch_field(reader, "rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(arch_field(reader, "feed_forward_length")),
        "num_hidden_layers": int(arch_field(reader, "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(arch_field(reader, "attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(arch_field(reader, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(arch_field(reader, "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(arch_field(reader, "context_length")),
        "vocab_size": int(arch_field(reader, "vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        **special_token_ids(reader),
        "torch_dtype": "float32",
    }


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection weight.

    llama.cpp stores each head's rows as interleaved pairs (x0, x_half, x1, x_half+1, ...): it
    reshaped rows to (heads, 2, head_dim/2) and swapped the last two axes. Reshaping to
    (heads, head_dim/2, 2) and swapping back restores HF's "first half, second half" order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return np.ascontiguousarray(
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


# Types whose tensors are plain numbers, not blocks: nothing to keep beside the float32 copy.
_UNBLOCKED = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _convert_tensors(
    reader: GGUFReader, config: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, GgufBlocks]]:
    """Every tensor as float32, and the block-quantized matrices' raw blocks, by HF name."""
    heads_for = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    progress = Progress("converting tensors", len(reader.tensors))
    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, GgufBlocks] = {}
    for done, tensor in enumerate(reader.tensors, start=1):
        hf_name, gguf_kind = _hf_name(tensor.name)
        weight = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        raw = tensor.data if tensor.tensor_type not in _UNBLOCKED and weight.ndim == 2 else None
        if gguf_kind in heads_for:
            weight = unpermute_rotary_rows(weight, heads_for[gguf_kind])
            raw = None if raw is None else unpermute_rotary_rows(raw, heads_for[gguf_kind])
        tensors[hf_name] = weight
        if raw is not None:
            shape = (weight.shape[0], weight.shape[1])
            blocks[hf_name] = GgufBlocks(np.array(raw, np.uint8), tensor.tensor_type.name, shape)
        progress.update(done, tensor.name)
    return tensors, blocks


def _hf_name(gguf_name: str) -> tuple[str, str]:
    """(HF name, GGUF kind) for a GGUF tensor name; ValueError for one we cannot place."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name], gguf_name
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    layer, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight", kind


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")

"""Write a tiny Llama GGUF file the way llama.cpp's converter would, for fast tests.

The weights are random HF-layout arrays; Q and K rows are permuted with llama.cpp's formula
before writing, and one tensor is stored Q8_0-quantized, so a converter that forgets either
step produces arrays that differ from `TinyLlama.hf_tensors`.

`write_tiny_llama_gguf(path, matrix_type="Q4_K")` stores every matrix (the embedding, the LM
head and each layer's projections) in that GGUF type instead (any type of
`tests.gguf_blocks.KERNEL_TYPES`; the K types need `hidden_size` and `intermediate_size` in
multiples of 256), as llama.cpp's quantized files do; `TinyLlama.hf_blocks` then holds each
matrix's blocks in HF row order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

from tests.gguf_blocks import gguf_blocks

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKEN = "<tool>"
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt he"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> GGML interleaved."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for bytes, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@dataclass
class TinyLlama:
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tokens: list[str] = field(default_factory=list)
    hf_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    # HF name -> (blocks [rows, bytes] in HF row order, GGUF type), with a `matrix_type`
    hf_blocks: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def write_tiny_llama_gguf(
    path: Path,
    seed: int = 0,
    matrix_type: str | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    kind_types: dict[str, str] | None = None,
    tied: bool = False,
    layer_spread: float = 1.0,
) -> TinyLlama:
    """Write the file and return what a correct conversion must reproduce. ``kind_types``
    gives some kinds of matrix (``attn_v``, ``ffn_down``, ...) a type other than
    ``matrix_type`` (as llama.cpp's Q4_K_M does); ``tied`` leaves out ``output.weight``;
    ``layer_spread``: the size of the layers' quantized matrices' values (about
    1 / sqrt(inputs) keeps the activations of the size a trained model's have)."""
    model = TinyLlama(hidden_size=hidden_size, intermediate_size=intermediate_size)
    rng = np.random.default_rng(seed)
    model.tokens = SPECIAL_TOKENS + byte_level_alphabet() + [m.replace(" ", "") for m in MERGES]
    model.tokens.append(USER_DEFINED_TOKEN)
    token_types = [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    token_types += [TokenType.NORMAL] * (len(model.tokens) - len(SPECIAL_TOKENS) - 1)
    token_types.append(TokenType.USER_DEFINED)

    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(model.context_length)
    writer.add_embedding_length(model.hidden_size)
    writer.add_block_count(model.num_layers)
    writer.add_feed_forward_length(model.intermediate_size)
    writer.add_head_count(model.num_heads)
    writer.add_head_count_kv(model.num_kv_heads)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_layer_norm_rms_eps(model.rms_norm_eps)
    writer.add_vocab_size(len(model.tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(model.tokens)
    writer.add_token_types([int(t) for t in token_types])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], heads: int = 0) -> None:
        kind = gguf_name.split(".")[-2]
        type_name = (kind_types or {}).get(kind, matrix_type)
        if type_name is not None and len(shape) == 2:
            spread = layer_spread if gguf_name.startswith("blk.") else 1.0
            blocks = gguf_blocks(type_name, shape[0], shape[1], rng, spread)
            model.hf_blocks[hf_name] = (blocks, type_name)
            model.hf_tensors[hf_name] = dequantize(blocks, GGMLQuantizationType[type_name])
            raw = llama_cpp_permute(blocks, heads) if heads else blocks
            writer.add_tensor(gguf_name, raw, raw_dtype=GGMLQuantizationType[type_name])
            return
        weight = rng.standard_normal(shape).astype(np.float32)
        model.hf_tensors[hf_name] = weight
        writer.add_tensor(gguf_name, llama_cpp_permute(weight, heads) if heads else weight)

    h, i, d = model.hidden_size, model.intermediate_size, model.head_dim
    add("token_embd.weight", "model.embed_tokens.weight", (len(model.tokens), h))
    for n in range(model.num_layers):
        blk, hf = f"blk.{n}", f"model.layers.{n}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (h,))
        add(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (h, h), model.num_heads)
        kv_shape = (model.num_kv_heads * d, h)
        add(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", kv_shape, model.num_kv_heads)
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", kv_shape)
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (h, h))
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (h,))
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (i, h))
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (i, h))
        down = f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight"
        if matrix_type is None and not kind_types:
            _add_q8_0(writer, model, rng, *down, (h, i))
        else:
            add(*down, (h, i))
    add("output_norm.weight", "model.norm.weight", (h,))
    if not tied:
        add("output.weight", "lm_head.weight", (len(model.tokens), h))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _add_q8_0(
    writer: GGUFWriter,
    model: TinyLlama,
    rng: np.random.Generator,
    gguf_name: str,
    hf_name: str,
    shape: tuple[int, int],
) -> None:
    """A quantized tensor: the converter must give back exactly its dequantized values."""
    weight = rng.standard_normal(shape).astype(np.float32)
    packed = quantize(weight, GGMLQuantizationType.Q8_0)
    model.hf_tensors[hf_name] = dequantize(packed, GGMLQuantizationType.Q8_0)
    model.hf_blocks[hf_name] = (packed, "Q8_0")
    writer.add_tensor(gguf_name, packed, raw_dtype=GGMLQuantizationType.Q8_0)

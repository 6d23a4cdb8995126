"""Conversion of a tiny synthetic Llama GGUF: weights, config and tokenizer (fast, no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_llama_gguf import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    USER_DEFINED_TOKEN,
    TinyLlama,
    llama_cpp_permute,
    write_tiny_llama_gguf,
)
from tokenizers import Tokenizer

from switchboard.checkpoint import convert_gguf_to_hf
from switchboard.checkpoint.gguf_blocks import read_gguf_blocks
from switchboard.checkpoint.gguf_to_hf import unpermute_rotary_rows


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyLlama, Path]:
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_llama_gguf(root / "tiny.gguf")
    out_dir = root / "hf"
    out_dir.mkdir()
    convert_gguf_to_hf(root / "tiny.gguf", out_dir)
    return model, out_dir


@pytest.mark.parametrize(("num_heads", "head_dim"), [(1, 4), (4, 16), (3, 64)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads: int, head_dim: int) -> None:
    weight = np.random.default_rng(1).standard_normal((num_heads * head_dim, 8))
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, num_heads), weight)


def test_unpermute_restores_rotate_half_row_order() -> None:
    # One head of dim 8: llama.cpp stores rows as pairs (0,4),(1,5),(2,6),(3,7).
    gguf_rows = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.float32)[:, None]
    assert unpermute_rotary_rows(gguf_rows, 1)[:, 0].tolist() == list(range(8))


def test_weights_match_under_hf_names(converted: tuple[TinyLlama, Path]) -> None:
    model, out_dir = converted
    tensors = load_file(str(out_dir / "model.safetensors"))
    assert set(tensors) == set(model.hf_tensors)
    for name, expected in model.hf_tensors.items():
        assert tensors[name].dtype == np.float32, name
        np.testing.assert_array_equal(tensors[name], expected, err_msg=name)


def test_quantized_matrices_keep_their_blocks(converted: tuple[TinyLlama, Path]) -> None:
    model, out_dir = converted
    blocks = read_gguf_blocks(out_dir)
    assert (
        set(blocks)
        == set(model.hf_blocks)
        == {f"model.layers.{n}.mlp.down_proj.weight" for n in (0, 1)}
    )
    for name, (expected, type_name) in model.hf_blocks.items():
        assert (blocks[name].type_name, blocks[name].shape) == (
            type_name,
            model.hf_tensors[name].shape,
        )
        np.testing.assert_array_equal(blocks[name].data, expected, err_msg=name)


def test_every_matrix_quantized_keeps_blocks_in_hf_row_order(tmp_path: Path) -> None:
    """A file of K-quantized matrices (Q and K rows permuted by llama.cpp): the blocks come back
    in HF row order, and the float32 weights are their dequantized values."""
    model = write_tiny_llama_gguf(
        tmp_path / "q4k.gguf", matrix_type="Q4_K", hidden_size=256, intermediate_size=512
    )
    convert_gguf_to_hf(tmp_path / "q4k.gguf", tmp_path)
    blocks = read_gguf_blocks(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(blocks) == set(model.hf_blocks) and len(blocks) == 2 + 2 * 7
    for name, (expected, type_name) in model.hf_blocks.items():
        assert blocks[name].type_name == type_name == "Q4_K"
        np.testing.assert_array_equal(blocks[name].data, expected, err_msg=name)
        np.testing.assert_array_equal(tensors[name], model.hf_tensors[name], err_msg=name)
    assert read_gguf_blocks(tmp_path, {"lm_head.weight"}).keys() == {"lm_head.weight"}


def test_config_comes_from_metadata(converted: tuple[TinyLlama, Path]) -> None:
    model, out_dir = converted
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == model.hidden_size
    assert config["intermediate_size"] == model.intermediate_size
    assert config["num_hidden_layers"] == model.num_layers
    assert config["num_attention_heads"] == model.num_heads
    assert config["num_key_value_heads"] == model.num_kv_heads
    assert config["head_dim"] == model.head_dim
    assert config["max_position_embeddings"] == model.context_length
    assert config["vocab_size"] == len(model.tokens)
    assert config["rope_theta"] == model.rope_theta
    assert config["rms_norm_eps"] == pytest.approx(model.rms_norm_eps)
    assert config["tie_word_embeddings"] is False  # the tiny file has output.weight
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["torch_dtype"] == "float32"
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tokenizer_rebuilt_from_metadata(converted: tuple[TinyLlama, Path]) -> None:
    model, out_dir = converted
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    vocab = {token: i for i, token in enumerate(model.tokens)}
    assert tokenizer.encode("hello the").ids == [vocab["hello"], vocab["Ġthe"]]
    # The smollm pre-tokenizer splits every digit on its own.
    assert tokenizer.encode("12").tokens == ["1", "2"]
    for token in [*SPECIAL_TOKENS, USER_DEFINED_TOKEN]:
        assert tokenizer.encode(f"a{token}b").ids == [vocab["a"], vocab[token], vocab["b"]]
    text = "hello, wörld! 42 <|im_start|>x<tool>"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "hello, wörld! 42 x<tool>"  # control tokens are special


def test_tokenizer_config_has_specials_and_template(converted: tuple[TinyLlama, Path]) -> None:
    _, out_dir = converted
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["pad_token"] == "<|im_end|>"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["added_tokens_decoder"]["1"]["special"] is True


def test_checkpoint_module_does_not_import_torch() -> None:
    code = "import sys, switchboard.checkpoint; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
